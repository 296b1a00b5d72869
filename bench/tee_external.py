"""bench/tee_external: the TEE's per-node temporal scorer on real labelled server data (SMD, ASD).

Protocol (shared/data/smd/README.md): per machine, fit on train, score test, metrics per machine,
unweighted mean over machines. One scorer configuration (``ScorerConfig()``, the defaults) for
both sets. Reported: AUC-PR (average precision), point-wise F1 at the best threshold on test
(oracle) and at a threshold chosen from train scores only (``ScorerConfig.quantile``), event
recall, Fc1 and detection delay (samples) at the train-only threshold, point-adjusted F1 only
beside the point-wise F1. The peer it is compared against is the best default pyod detector of
the data README (PCA on SMD, LOF on ASD), run here in the same way (one model per machine, fitted
on train, raw decision scores).

Run: ``.venv/bin/python bench/tee_external.py [--data ../shared/data] [--sets smd,asd]``.
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

from transom.streams.scoring import ScorerConfig, TemporalScorer

TARGETS = {"smd": {"auc_pr": 0.55, "best_f1": 0.60, "event_recall_train_thr": 0.9},
           "asd": {"auc_pr": 0.40, "best_f1": 0.45}}
PEER = {"smd": "pca", "asd": "lof"}


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


def evaluate(y: np.ndarray, s: np.ndarray, thr: float) -> dict:
    segs = segments(y)
    pred = s > thr
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


def peer_scores(name: str, tr: np.ndarray, te: np.ndarray) -> np.ndarray:
    keep = tr.std(0) > 1e-9
    if name == "pca":
        from pyod.models.pca import PCA
        m = PCA()
    else:
        from pyod.models.lof import LOF
        m = LOF()
    m.fit(tr[:, keep])
    return m.decision_function(te[:, keep])


def machines(root: str, ds: str):
    for f in sorted(glob.glob(os.path.join(root, ds, "train", "*.txt.gz"))):
        m = os.path.basename(f)[:-len(".txt.gz")]
        tr = np.loadtxt(f, delimiter=",")
        te = np.loadtxt(os.path.join(root, ds, "test", f"{m}.txt.gz"), delimiter=",")
        y = np.loadtxt(os.path.join(root, ds, "test_label", f"{m}.txt"), dtype=int)
        yield m, tr, te, y


def run_set(root: str, ds: str, config: ScorerConfig) -> dict:
    per, peer = {}, {}
    pooled_hit = pooled = 0
    for m, tr, te, y in machines(root, ds):
        t = time.time()
        scorer = TemporalScorer(config).fit(tr)
        s = scorer.score(te)
        per[m] = evaluate(y, s, scorer.threshold)
        pooled_hit += per[m]["segments_hit"]
        pooled += per[m]["segments"]
        ps = peer_scores(PEER[ds], tr, te)
        peer[m] = {"auc_pr": float(average_precision_score(y, ps)), "best_f1": best_f1(y, ps)}
        print(f"{ds} {m}: auc_pr {per[m]['auc_pr']:.3f} best_f1 {per[m]['best_f1']:.3f} "
              f"f1@train {per[m]['f1_train_thr']:.3f} event_recall {per[m]['event_recall_train_thr']:.2f} "
              f"| {PEER[ds]} {peer[m]['auc_pr']:.3f}/{peer[m]['best_f1']:.3f} ({time.time() - t:.0f}s)",
              file=sys.stderr, flush=True)
    keys = [k for k in next(iter(per.values())) if k not in ("segments", "segments_hit")]
    mean = {}
    for k in keys:
        vals = [v[k] for v in per.values() if v[k] is not None]
        mean[k] = round(float(np.mean(vals)), 4) if vals else None
    mean["event_recall_pooled"] = round(pooled_hit / max(pooled, 1), 4)
    peer_mean = {k: round(float(np.mean([v[k] for v in peer.values()])), 4) for k in ("auc_pr", "best_f1")}
    targets = {k: {"value": mean[k], "target": v, "met": mean[k] is not None and mean[k] >= v}
               for k, v in TARGETS[ds].items()}
    return {"mean": mean, "peer": {"detector": f"pyod.{PEER[ds]} (default)", **peer_mean},
            "ratio_to_peer": {k: round(mean[k] / max(peer_mean[k], 1e-9), 3) for k in ("auc_pr", "best_f1")},
            "targets": targets,
            "per_machine": {m: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}
                            for m, d in per.items()}}


def main(argv=None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=os.path.normpath(os.path.join(here, "..", "..", "shared", "data")),
                   help="folder holding smd/ and asd/ (default ../shared/data)")
    p.add_argument("--sets", default="smd,asd")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    config = ScorerConfig()
    t = time.time()
    out = {"bench": "tee_external", "config": {k: getattr(config, k) for k in config.__dataclass_fields__},
           "threshold": f"train-score quantile {config.quantile} (no test labels)"}
    for ds in a.sets.split(","):
        out[ds] = run_set(a.data, ds, config)
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
