"""bench/tee_external: the TEE's per-node temporal scorer on real labelled server data (SMD, ASD).

Protocol (shared/data/smd/README.md): per machine, fit on train, score test, metrics per machine,
unweighted mean over machines. Test is scored after train, as a node's new rows follow its history in
the engine: the scorer's views read the rows before each row (its ``level_window`` of them at most). One scorer configuration (``ScorerConfig()``, the defaults: the
scorer the TEE engine's temporal detector runs) for both sets. The threshold is chosen without
test labels: the scorer holds out the newest ``validation`` share of train, fits on the rest and
starts its threshold by peaks over threshold on the held-out scores; over test, row by row, drift
SPOT moves it with the level of the scores that raised no alarm (``DriftSpot``, what the engine's
temporal detector runs on the live stream). Graded at those alarms: point-wise F1 (and precision, recall), event recall, Fc1, detection delay; beside
them, only as information, AUC-PR and the best point-wise F1 over all thresholds (chosen on test
labels, an oracle) and the ratio of the two F1s. The default pyod detectors (``--pyod``) run the
same way (fitted on the same part of train, thresholded by the same POT rule on the same
validation rows, raw decision scores).

Settings were chosen looking at the machines of ``TUNING_MACHINES`` only (SMD machine-1-*, ASD
omi-1..6); ``mean_report_machines`` is the mean over the others, never looked at while tuning. The
issue's targets are graded on the mean over all machines.

Run: ``.venv/bin/python bench/tee_external.py [--data ../shared/data] [--sets smd,asd]`` (about
1 min without pyod: ``--pyod ''``; 2-3 min with the 4 default detectors).
Prints progress on stderr and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
import warnings

import numpy as np
from sklearn.metrics import average_precision_score, precision_recall_curve

from transom.streams.scoring import ScorerConfig, TemporalScorer, pot_threshold

TARGETS = {"smd": {"f1_train_thr": 0.45, "auc_pr": 0.55, "event_recall_train_thr": 0.9, "f1_ratio_to_best": 0.75},
           "asd": {"f1_train_thr": 0.40, "auc_pr": 0.40, "f1_ratio_to_best": 0.75}}
#: Machines the scorer's settings were chosen on (house rule 4: the figures of the others are the ones
#: never looked at while tuning; ``mean_report_machines`` averages those alone).
TUNING_MACHINES = {"smd": ("machine-1-2", "machine-1-5", "machine-1-6", "machine-1-8"),
                   "asd": ("omi-1", "omi-2", "omi-3", "omi-4", "omi-5", "omi-6")}
PYOD = {"pca": "pyod.models.pca.PCA", "lof": "pyod.models.lof.LOF", "ecod": "pyod.models.ecod.ECOD",
        "iforest": "pyod.models.iforest.IForest"}


def segments(y: np.ndarray) -> list[tuple[int, int]]:
    d = np.diff(np.concatenate([[0], y, [0]]))
    return list(zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))   # [start, end)


def point_f1(y: np.ndarray, pred: np.ndarray) -> tuple[float, float, float]:
    tp = float((pred & (y == 1)).sum())
    p = tp / max(pred.sum(), 1)
    r = tp / max((y == 1).sum(), 1)
    return p, r, (2 * p * r / (p + r) if p + r else 0.0)


def best_f1(y: np.ndarray, s: np.ndarray) -> float:
    p, r, _ = precision_recall_curve(y, s)
    return float(np.max(2 * p * r / np.maximum(p + r, 1e-12)))


def best_f1_pa(y: np.ndarray, s: np.ndarray, segs) -> float:
    adj = s.copy()
    for a, b in segs:
        adj[a:b] = s[a:b].max()
    return best_f1(y, adj)


def evaluate(y: np.ndarray, s: np.ndarray, pred: np.ndarray) -> dict:
    """Figures of scores ``s`` and alarms ``pred`` (the scorer's train-only threshold rule) against labels ``y``."""
    segs = segments(y)
    p, r, f1 = point_f1(y, pred)
    hit, delays = 0, []
    for a, b in segs:
        idx = np.flatnonzero(pred[a:b])
        if len(idx):
            hit += 1
            delays.append(int(idx[0]))
    er = hit / max(len(segs), 1)
    return {"auc_pr": float(average_precision_score(y, s)), "best_f1": best_f1(y, s),
            "best_f1_pa": best_f1_pa(y, s, segs), "f1_train_thr": f1, "precision_train_thr": p,
            "recall_train_thr": r, "event_recall_train_thr": er,
            "fc1_train_thr": (2 * p * er / (p + er) if p + er else 0.0),
            "delay_mean": float(np.mean(delays)) if delays else None,
            "delay_median": float(np.median(delays)) if delays else None,
            "segments": len(segs), "segments_hit": hit}


def pyod_under_the_same_rule(name: str, tr: np.ndarray, te: np.ndarray, y: np.ndarray, config: ScorerConfig) -> dict:
    """A default pyod model fitted on the scorer's fit part of train, thresholded by the scorer's rule (DSPOT
    or POT) started on its scores of the same validation rows."""
    from transom.streams.scoring import DriftSpot, StaticThreshold, _import
    cut = int(len(tr) * (1 - config.validation))
    keep = tr[:cut].std(0) > 1e-9
    m = _import(PYOD[name])()
    m.fit(tr[:cut, keep])
    held = m.decision_function(tr[cut:, keep])
    th = (DriftSpot(held, config.drift_depth, config.pot_risk, config.pot_level, config.refit_peaks)
          if config.threshold_rule == "dspot" else StaticThreshold(pot_threshold(held, config.pot_risk, config.pot_level)))
    s = m.decision_function(te[:, keep])
    _, _, f1 = point_f1(y, th.step(s))
    return {"f1_train_thr": f1, "auc_pr": float(average_precision_score(y, s)), "best_f1": best_f1(y, s)}


def machines(root: str, ds: str):
    for f in sorted(glob.glob(os.path.join(root, ds, "train", "*.txt.gz"))):
        m = os.path.basename(f)[:-len(".txt.gz")]
        tr = np.loadtxt(f, delimiter=",")
        te = np.loadtxt(os.path.join(root, ds, "test", f"{m}.txt.gz"), delimiter=",")
        y = np.loadtxt(os.path.join(root, ds, "test_label", f"{m}.txt"), dtype=int)
        yield m, tr, te, y


def run_set(root: str, ds: str, config: ScorerConfig, pyod: list[str]) -> dict:
    per, peer = {}, {name: {} for name in pyod}
    pooled_hit = pooled = 0
    for m, tr, te, y in machines(root, ds):
        t = time.time()
        scorer = TemporalScorer(config).fit(tr)
        s = scorer.score(np.vstack([tr, te]), last=len(te))   # test follows train, as a node's rows follow its history
        per[m] = evaluate(y, s, scorer.thresholder().step(s))     # the stream's alarms, test row by row
        pooled_hit += per[m]["segments_hit"]
        pooled += per[m]["segments"]
        for name in pyod:
            peer[name][m] = pyod_under_the_same_rule(name, tr, te, y, config)
        print(f"{ds} {m}: f1@train-thr {per[m]['f1_train_thr']:.3f} (p {per[m]['precision_train_thr']:.2f} "
              f"r {per[m]['recall_train_thr']:.2f}) event_recall {per[m]['event_recall_train_thr']:.2f} "
              f"| best_f1 {per[m]['best_f1']:.3f} auc_pr {per[m]['auc_pr']:.3f} | "
              + " ".join(f"{n} {peer[n][m]['f1_train_thr']:.3f}" for n in pyod) + f" ({time.time() - t:.0f}s)",
              file=sys.stderr, flush=True)
    keys = [k for k in next(iter(per.values())) if k not in ("segments", "segments_hit")]
    mean = {}
    for k in keys:
        vals = [v[k] for v in per.values() if v[k] is not None]
        mean[k] = round(float(np.mean(vals)), 4) if vals else None
    report = [v for m, v in per.items() if m not in TUNING_MACHINES.get(ds, ())]
    mean_report = {k: round(float(np.mean([v[k] for v in report if v[k] is not None])), 4)
                   for k in ("f1_train_thr", "best_f1", "auc_pr", "event_recall_train_thr")} if report else {}
    mean["event_recall_pooled"] = round(pooled_hit / max(pooled, 1), 4)
    mean["f1_ratio_to_best"] = round(mean["f1_train_thr"] / max(mean["best_f1"], 1e-9), 4)
    pyod_mean = {n: {k: round(float(np.mean([v[k] for v in d.values()])), 4) for k in ("f1_train_thr", "auc_pr", "best_f1")}
                 for n, d in peer.items()}
    targets = {k: {"value": mean[k], "target": v, "met": mean[k] is not None and mean[k] >= v}
               for k, v in TARGETS[ds].items()}
    return {"mean": mean, "mean_report_machines": {"machines": len(report), **mean_report},
            "tuning_machines": list(TUNING_MACHINES.get(ds, ())),
            "pyod_defaults_same_threshold_rule": pyod_mean, "targets": targets,
            "per_machine": {m: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}
                            for m, d in per.items()}}


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=os.path.normpath(os.path.join(here, "..", "..", "shared", "data")),
                   help="folder holding smd/ and asd/ (default ../shared/data)")
    p.add_argument("--sets", default="smd,asd")
    p.add_argument("--pyod", default="pca,lof,ecod,iforest",
                   help="default pyod detectors scored beside it under the same threshold rule ('' for none)")
    a = p.parse_args(argv)
    pyod = [n for n in a.pyod.split(",") if n]
    unknown = sorted(set(pyod) - set(PYOD))
    if unknown:
        p.error(f"--pyod: unknown detector(s) {', '.join(unknown)}; expected some of {', '.join(PYOD)}")
    warnings.filterwarnings("ignore")
    config = ScorerConfig()
    t = time.time()
    out = {"bench": "tee_external", "config": {k: getattr(config, k) for k in config.__dataclass_fields__},
           "threshold": (f"{config.threshold_rule}: POT on the newest {config.validation:.0%} of train held out "
                         f"(level {config.pot_level}, risk {config.pot_risk})"
                         + (f", then drift SPOT over the test stream (depth {config.drift_depth}: scores against "
                            "the mean of the latest scores without an alarm; alarms teach nothing)"
                            if config.threshold_rule == "dspot" else "") + "; no test labels"),
           "info_only": "auc_pr and best_f1 use test labels (an oracle threshold): information, not graded"}
    for ds in a.sets.split(","):
        out[ds] = run_set(a.data, ds, config, pyod)
    out["all_targets_met"] = all(t["met"] for ds in a.sets.split(",") for t in out[ds]["targets"].values())
    out["seconds"] = round(time.time() - t, 1)
    compact = {k: v for k, v in out.items()}
    for ds in a.sets.split(","):
        compact[ds] = {k: v for k, v in out[ds].items() if k != "per_machine"}
    with open(os.environ.get("TEE_EXTERNAL_DETAIL", os.path.join(tempfile.gettempdir(), "tee_external_per_machine.json")), "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(compact))
    return 0


if __name__ == "__main__":
    sys.exit(main())
