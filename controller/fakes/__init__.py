"""Fakes of the platforms the controller drives, for tests on machines without them (never a default).

- :mod:`.kube`: a Kubernetes API server (the REST paths the official client calls for nodes, pods
  and services) with a fake kubelet that runs each pod's command as a local process;
- :mod:`.slurm`: ``scontrol``, ``squeue``, ``srun`` and ``scancel`` executables that keep the
  cluster's state in one JSON file and run job steps as local processes.
"""

__all__: list[str] = []
