"""Per-node temporal scoring: fit on a node's clean history, score new samples (no Faust here).

Contract::

    scorer = TemporalScorer(ScorerConfig()).fit(history)   # history: (n, d) array, rows in time order
    scorer.score(X)          # (m,) scores for rows of X in time order (causal: row i sees rows <= i)
    scorer.score(X, last=n)  # the scores of the last n rows only (the views still read the rows before)
    scorer.threshold         # chosen without labels: POT on a held-out validation split of the history
    th = scorer.thresholder()  # the threshold that follows the stream (drift SPOT, default), seeded the same way
    th.step(scores)          # (m,) bool: alarms for new scores, in time order (state carries over calls)
    scorer.contributions(x)  # per feature, how far x lies from the history (for evidence)

The score is an ensemble of members (``members``; pyod names or ``knn`` / ``pca``), each over a view
of the rows (a suffix of its name; none: the scaled values):

- ``_resid``: each row minus the mean of the ``residual_window`` rows before it (a sudden change);
- ``_joint``: the values side by side with those residuals (a level and a change judged together);
- ``_var``: each row's error against a ridge autoregression fitted on the history, every column
  predicted from every column of the ``var_lags`` rows before it (``var_ridge`` penalty): a row that
  breaks how the node's columns follow each other, though each value stays in its usual range;
- ``_level``: each row minus the mean of the ``level_window`` rows before it, beside its ``_resid``
  residuals: a new level is flagged at once and is the norm once it has held that long.

Each member is rank-normalised against its own scores on the history: ``(s - median) / (q99 -
median)``, so members with different units add up. Features are min-max scaled by the history
(constant features dropped, values clipped to [-3, 4] of the range), then each member's score is
smoothed by an exponentially weighted trailing mean of span ``smooth`` (``level_smooth`` for the
``_level`` members: a fault lasts; noise does not). The kNN member scores a row by its mean distance
to the k nearest rows of a small seeded sample of the history (``knn_sample`` rows), averaged over
``knn_bags`` independent samples: a small sample rarely holds the history's few odd rows (the
history is not labelled and may hold faults), and the average removes the luck of one draw. The
defaults (``knn_var``, lags 5, ridge 10, and ``knn_level``, level window 3,000, residual window 10;
k=5, 4 samples of 1000 rows, spans 8 and 3; DSPOT with level 0.85 and depth 1000) are the one
configuration ``bench/tee_external.py`` scores on both SMD and ASD. The kNN search is brute force in
numpy: the engine scores a few dozen rows at a time, where a search tree's per-call overhead costs more than the search.

Threshold (``threshold_rule``): "pot" holds out the last ``validation`` share of the
history, fits the members on the rest, scores the held-out rows (out of sample, as new data will
be) and sets the threshold by peaks over threshold (:func:`pot_threshold`: a generalised Pareto
tail fitted to the scores above their ``pot_level`` quantile, read at risk ``pot_risk``; the
first step of SPOT, Siffer et al. KDD 2017, as OmniAnomaly thresholds SMD). "dspot" (the
default): the same start, then DSPOT (drift SPOT, same paper) over the stream: each score is taken
relative to the mean of the ``drift_depth`` scores before it that raised no alarm, the tail is
fitted to the held-out scores taken that way, and scores that raise no alarm but exceed the initial
level add to the tail (refitted every ``refit_peaks`` new peaks). A node (or server) whose normal
score level creeps up over weeks then keeps its false alarms in check; an alarm never moves the
threshold (a long fault is not learnt as normal). "quantile": the ``quantile`` of the in-sample
history scores. No label is used by any rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from transom.config import ConfigError

__all__ = ["ScorerConfig", "TemporalScorer", "ewma", "residuals", "lagged", "pot_threshold", "DriftSpot",
           "StaticThreshold", "PYOD_MODELS", "VIEWS"]

#: Member names that map onto pyod models (built with their defaults and ``contamination``).
PYOD_MODELS = {"ecod": "pyod.models.ecod.ECOD", "iforest": "pyod.models.iforest.IForest",
               "copod": "pyod.models.copod.COPOD", "hbos": "pyod.models.hbos.HBOS",
               "lof": "pyod.models.lof.LOF", "pyod_pca": "pyod.models.pca.PCA"}


@dataclass(frozen=True)
class ScorerConfig:
    #: ensemble members: "knn" (mean distance to the k nearest sampled history rows), "pca" (reconstruction
    #: error with components for ``pca_variance`` of the variance), or a name of ``PYOD_MODELS``;
    #: each also over another view of the rows: "<name>_resid", "_joint", "_var" or "_level" (``VIEWS``)
    members: tuple[str, ...] = ("knn_var", "knn_level")
    #: rows of the trailing mean the ``_resid``, ``_joint`` and ``_level`` members subtract
    residual_window: int = 10
    #: ``_var`` members: each row's error against a ridge autoregression on the ``var_lags`` rows
    #: before it (every column from every column), fitted on the history ...
    var_lags: int = 5
    #: ... with this ridge penalty on the coefficients (features are min-max scaled)
    var_ridge: float = 10.0
    #: ``_level`` members: each row against the mean of the ``level_window`` rows before it (a level
    #: that has held for longer becomes the norm), beside its residual against ``residual_window``
    level_window: int = 3000
    #: neighbours of the kNN member
    k: int = 5
    #: history rows in each seeded sample the kNN member searches (small: leaves out the
    #: history's rare, possibly faulty rows, and keeps scoring fast)
    knn_sample: int = 1000
    #: independent samples (seeds ``seed``, ``seed + 1``, ...) whose kNN distances are averaged
    knn_bags: int = 4
    #: share of variance the PCA member's components explain
    pca_variance: float = 0.9
    #: span of the exponentially weighted trailing mean of each member's score (weight 2/(span+1)
    #: on the newest sample; 1: no smoothing) ...
    smooth: int = 8
    #: ... and of the ``_level`` members' (their residual half sees a change at once: a shorter span
    #: keeps a fault of a few rows, which the autoregression errors, smoothed longer, leave to them)
    level_smooth: int = 3
    #: the threshold is this quantile of the smoothed history scores (0.98: a fault found early
    #: matters more than a few more alarms to look at; see bench/tee_external.py)
    quantile: float = 0.98
    #: multiplies the threshold (margin for the unseen)
    margin: float = 1.0
    seed: int = 0
    #: "dspot": drift SPOT over the stream, started on held-out history scores; "pot": peaks over
    #: threshold on held-out history scores, fixed; "quantile": ``quantile`` of in-sample scores
    threshold_rule: str = "dspot"
    #: DSPOT: scores whose mean (those without an alarm) is the moving level scores are taken against
    #: (at most half the held-out scores)
    drift_depth: int = 1000
    #: DSPOT: refit the tail once every this many new peaks
    refit_peaks: int = 20
    #: share of the history (its newest rows) held out to choose the threshold on
    validation: float = 0.3
    #: POT: the initial threshold is this quantile of the held-out scores ...
    pot_level: float = 0.85
    #: ... and the threshold the score exceeded with this probability under the fitted tail
    pot_risk: float = 1e-2

    def span(self, member: str) -> int:
        """The smoothing span of ``member``'s score."""
        return self.level_smooth if member.endswith("_level") else self.smooth

    @property
    def warmup(self) -> int:
        """Rows the smoothing is warmed up on before the first row whose score is wanted."""
        return 5 * max(self.span(m) for m in self.members)

    @property
    def context(self) -> int:
        """Rows before a row that its members' views read (scoring a row needs that many before it)."""
        need = [self.residual_window]
        if any(m.endswith("_var") for m in self.members):
            need.append(self.var_lags)
        if any(m.endswith("_level") for m in self.members):
            need.append(self.level_window)
        return max(need)

    def __post_init__(self) -> None:
        for m in self.members:
            m = _base(m)
            if m not in ("knn", "pca") and m not in PYOD_MODELS:
                raise ConfigError(f"scorer member {m!r}: expected knn, pca or one of {', '.join(PYOD_MODELS)}"
                                  f" (optionally with {', '.join(VIEWS)})")
        if not self.members:
            raise ConfigError("scorer members: expected at least one")
        if not 0.5 < self.quantile < 1:
            raise ConfigError(f"scorer quantile={self.quantile!r}: expected a share between 0.5 and 1")
        if self.threshold_rule not in ("dspot", "pot", "quantile"):
            raise ConfigError(f"scorer threshold_rule={self.threshold_rule!r}: expected dspot, pot or quantile")
        if not 0 < self.validation < 0.9:
            raise ConfigError(f"scorer validation={self.validation!r}: expected a share between 0 and 0.9")
        if not 0.5 < self.pot_level < 1 or not 0 < self.pot_risk < 0.1:
            raise ConfigError(f"scorer pot_level={self.pot_level!r}, pot_risk={self.pot_risk!r}: expected a level "
                              "between 0.5 and 1 and a risk between 0 and 0.1")
        if isinstance(self.var_ridge, bool) or not isinstance(self.var_ridge, (int, float)) or not self.var_ridge > 0:
            raise ConfigError(f"scorer var_ridge={self.var_ridge!r}: expected a number > 0 (the penalty also keeps "
                              "the autoregression solvable when columns move together)")
        for f in ("k", "knn_sample", "knn_bags", "smooth", "level_smooth", "residual_window", "drift_depth",
                  "refit_peaks", "var_lags", "level_window"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ConfigError(f"scorer {f}={getattr(self, f)!r}: expected a positive integer")


def lagged(X: np.ndarray, lags: int) -> np.ndarray:
    """Each row's ``lags`` rows before it side by side (newest first), then a 1 (the intercept); rows
    before the first are taken as the first."""
    P = np.vstack([np.repeat(X[:1], lags, 0), X])
    return np.hstack([P[lags - j - 1:len(P) - j - 1] for j in range(lags)] + [np.ones((len(X), 1))])


def ewma(s: np.ndarray, span: int) -> np.ndarray:
    """Causal exponentially weighted mean: out[0] = s[0], out[i] = a*s[i] + (1-a)*out[i-1], a = 2/(span+1)."""
    s = np.asarray(s, dtype=float)
    if span <= 1 or not len(s):
        return s
    from scipy.signal import lfilter
    a = 2.0 / (span + 1)
    return lfilter([a], [1.0, a - 1.0], s, zi=[(1 - a) * s[0]])[0]


def pot_threshold(scores: np.ndarray, risk: float = 1e-3, level: float = 0.98) -> float:
    """Peaks over threshold: fit a generalised Pareto distribution to the excesses of ``scores`` over
    their ``level`` quantile and return the score exceeded with probability ``risk`` under it."""
    from scipy.stats import genpareto
    s = np.asarray(scores, dtype=float)
    s = s[np.isfinite(s)]
    t = float(np.quantile(s, level))
    peaks = s[s > t] - t
    if len(peaks) < 10 or float(peaks.std()) <= 0:
        return float(np.quantile(s, 1 - risk))
    gamma, _, sigma = genpareto.fit(peaks, floc=0)
    r = risk * len(s) / len(peaks)
    if abs(gamma) < 1e-6:
        return t - sigma * float(np.log(r))
    return t + sigma / gamma * (r ** -gamma - 1)


def _gpd_quantile(peaks: np.ndarray, n: int, t: float, risk: float) -> float:
    """The score exceeded with probability ``risk`` when ``peaks`` (excesses over ``t``) of ``n`` scores
    follow a generalised Pareto tail."""
    from scipy.stats import genpareto
    if len(peaks) < 10 or float(np.std(peaks)) <= 0:
        return t + (float(np.max(peaks)) if len(peaks) else 0.0)
    gamma, _, sigma = genpareto.fit(peaks, floc=0)
    r = risk * n / len(peaks)
    if abs(gamma) < 1e-6:
        return t - sigma * float(np.log(r))
    return t + sigma / gamma * (r ** -gamma - 1)


class StaticThreshold:
    """A fixed threshold with the :class:`DriftSpot` interface."""

    def __init__(self, threshold: float) -> None:
        self.threshold = float(threshold)

    def step(self, scores) -> np.ndarray:
        return np.asarray(scores, dtype=float) > self.threshold


class DriftSpot:
    """DSPOT (Siffer et al., KDD 2017): peaks over threshold on scores taken relative to the mean of the
    ``depth`` latest scores that raised no alarm. Started on ``initial`` (held-out, label-free) scores;
    :meth:`step` gives the alarms of new scores in time order and learns from those without one."""

    def __init__(self, initial, depth: int = 500, risk: float = 1e-2, level: float = 0.98, refit: int = 20,
                 margin: float = 1.0) -> None:
        v = np.asarray(initial, dtype=float)
        v = v[np.isfinite(v)]
        self.depth = d = max(1, min(depth, len(v) // 2))
        c = np.concatenate([[0.0], np.cumsum(v)])
        rel = v[d:] - (c[d:-1] - c[:-d - 1]) / d          # each score against the mean of the d before it
        self.risk, self.refit, self.margin = risk, refit, margin
        self.t = float(np.quantile(rel, level))
        self.peaks = list(rel[rel > self.t] - self.t)
        self.n, self.added = len(rel), 0
        self.z = _gpd_quantile(np.array(self.peaks), self.n, self.t, risk)
        self.window = list(v[-d:])
        self.total = float(np.sum(self.window))
        self._i = 0                                        # the oldest score of ``window`` (a ring)

    @property
    def threshold(self) -> float:
        """The threshold the next score is compared with (the moving level plus the tail's)."""
        return self.total / self.depth + self.z * self.margin

    def step(self, scores) -> np.ndarray:
        scores = np.asarray(scores, dtype=float)
        out = np.zeros(len(scores), dtype=bool)
        for i, x in enumerate(scores.tolist()):
            rel = x - self.total / self.depth
            if rel > self.z * self.margin or not np.isfinite(x):
                out[i] = True                              # an alarm teaches nothing
                continue
            if rel > self.t:
                self.peaks.append(rel - self.t)
                self.added += 1
                if self.added % self.refit == 0:
                    self.z = _gpd_quantile(np.array(self.peaks), self.n, self.t, self.risk)
            self.n += 1
            self.total += x - self.window[self._i]
            self.window[self._i] = x
            self._i = (self._i + 1) % self.depth
        return out


#: Member suffixes: the view of the rows a member's model sees (none: the scaled values).
VIEWS = ("_resid", "_joint", "_var", "_level")


def _base(member: str) -> str:
    for suffix in VIEWS:
        if member.endswith(suffix):
            return member[:-len(suffix)]
    return member


def residuals(X: np.ndarray, w: int) -> np.ndarray:
    """Each row minus the mean of the ``w`` rows before it (the first row: itself, so 0)."""
    c = np.vstack([np.zeros((1, X.shape[1])), np.cumsum(X, 0)])
    i = np.arange(len(X))
    a = np.maximum(0, i - w)
    n = np.maximum(i - a, 1)
    mean = (c[i] - c[a]) / n[:, None]
    mean[0] = X[0]
    return X - mean


def _import(path: str) -> Any:
    mod, _, name = path.rpartition(".")
    return getattr(__import__(mod, fromlist=[name]), name)


class _Knn:
    """Mean distance to the ``k`` nearest rows of ``bags`` seeded samples of the history, averaged over
    the samples. Brute force in numpy (one matrix product per block of rows): the engine scores a few
    dozen rows at a time, where a tree's per-call overhead costs more than the search."""

    def __init__(self, k: int, sample: int, bags: int, seed: int) -> None:
        self.k, self.sample, self.bags, self.seed = k, sample, bags, seed

    def fit(self, X: np.ndarray) -> np.ndarray:
        self.refs = []
        for b in range(self.bags):
            rng = np.random.default_rng(self.seed + b)
            idx = rng.choice(len(X), min(self.sample, len(X)), replace=False)
            R = np.ascontiguousarray(X[idx])
            self.refs.append((R, (R * R).sum(1)))
        self.kk = min(self.k, min(len(R) for R, _ in self.refs))
        return self._mean_dist(X, leave_one=True)   # a history row is in some samples: leave it out

    def score(self, X: np.ndarray) -> np.ndarray:
        return self._mean_dist(X, leave_one=False)

    def _mean_dist(self, X: np.ndarray, leave_one: bool, block: int = 2048) -> np.ndarray:
        out = np.zeros(len(X))
        for a in range(0, len(X), block):
            Q = X[a:a + block]
            q2 = (Q * Q).sum(1)[:, None]
            for R, r2 in self.refs:
                k = min(self.kk + leave_one, len(R))
                d2 = np.maximum(q2 + r2[None, :] - 2.0 * (Q @ R.T), 0.0)
                d = np.sqrt(np.partition(d2, k - 1, axis=1)[:, :k] if k < len(R) else d2)
                if leave_one and k > 1:
                    d = np.sort(d, 1)[:, 1:]              # the nearest is the row itself (distance 0)
                out[a:a + block] += d.mean(1)
        return out / len(self.refs)


class _Pca:
    def __init__(self, variance: float) -> None:
        self.variance = variance

    def fit(self, X: np.ndarray) -> np.ndarray:
        from sklearn.decomposition import PCA
        n = min(X.shape)
        self.p = PCA(n_components=self.variance if n > 1 else None, svd_solver="full").fit(X)
        return self.score(X)

    def score(self, X: np.ndarray) -> np.ndarray:
        r = X - self.p.inverse_transform(self.p.transform(X))
        return (r ** 2).sum(1)


class _Pyod:
    def __init__(self, name: str) -> None:
        self.model = _import(PYOD_MODELS[name])()

    def fit(self, X: np.ndarray) -> np.ndarray:
        self.model.fit(X)
        return np.asarray(self.model.decision_scores_, dtype=float)

    def score(self, X: np.ndarray) -> np.ndarray:
        return np.asarray(self.model.decision_function(X), dtype=float)


class TemporalScorer:
    """The ensemble of :class:`ScorerConfig`, fitted on one node's history."""

    def __init__(self, config: ScorerConfig | None = None) -> None:
        self.config = config or ScorerConfig()
        self.threshold = float("nan")

    def _scale(self, X: np.ndarray) -> np.ndarray:
        return np.clip((X[:, self.keep] - self.lo) / self.range, -3.0, 4.0)

    def fit(self, history: np.ndarray) -> "TemporalScorer":
        H = np.asarray(history, dtype=float)
        if H.ndim != 2 or len(H) < 10:
            raise ValueError(f"history must be a 2-d array of at least 10 rows, got shape {H.shape}")
        cfg = self.config
        if cfg.threshold_rule in ("pot", "dspot") and len(H) >= 200:
            cut = int(len(H) * (1 - cfg.validation))
            self._fit(H[:cut])
            # the held-out rows are scored as the stream's rows will be: after the rows before them
            held = self.score(H, last=len(H) - cut)
            self.validation_scores = held
            self.threshold = pot_threshold(held, cfg.pot_risk, cfg.pot_level) * cfg.margin
            return self
        self._fit(H)
        self.validation_scores = None
        self.threshold = float(np.quantile(self.history_scores, cfg.quantile)) * cfg.margin
        return self

    def thresholder(self) -> "DriftSpot | StaticThreshold":
        """A fresh stream thresholder: DSPOT started on the held-out scores (rule "dspot", with enough
        history), else the fixed :attr:`threshold`."""
        cfg = self.config
        if cfg.threshold_rule == "dspot" and self.validation_scores is not None:
            return DriftSpot(self.validation_scores, cfg.drift_depth, cfg.pot_risk, cfg.pot_level, cfg.refit_peaks,
                             cfg.margin)
        return StaticThreshold(self.threshold)

    def _fit(self, H: np.ndarray) -> None:
        lo, hi = H.min(0), H.max(0)
        self.keep = (hi - lo) > 1e-9
        if not self.keep.any():
            self.keep[:] = True
        self.lo, self.range = lo[self.keep], np.maximum((hi - lo)[self.keep], 1e-9)
        self.center = np.median(H, 0)
        self.spread = np.maximum(np.percentile(H, 95, 0) - np.percentile(H, 5, 0), 1e-9)
        X = self._scale(H)
        cfg = self.config
        self.var_coef = None
        if any(m.endswith("_var") for m in cfg.members):
            D = lagged(X, cfg.var_lags)
            self.var_coef = np.linalg.solve(D.T @ D + cfg.var_ridge * np.eye(D.shape[1]), D.T @ X)
        self.members, self.norms = [], []
        total = np.zeros(len(X))
        for full in cfg.members:
            name = _base(full)
            m = (_Knn(cfg.k, cfg.knn_sample, cfg.knn_bags, cfg.seed) if name == "knn" else
                 _Pca(cfg.pca_variance) if name == "pca" else _Pyod(name))
            s = ewma(m.fit(self._view(full, X)), cfg.span(full))
            med, q = float(np.median(s)), float(np.percentile(s, 99))
            self.members.append(m)
            self.norms.append((med, max(q - med, 1e-12)))
            total += (s - med) / (q - med if q > med else 1e-12)
        self.history_scores = total

    def _view(self, member: str, X: np.ndarray, start: int = 0) -> np.ndarray:
        """What ``member``'s model sees of the rows of ``X`` from ``start`` on (each view reads only the
        rows it needs before ``start``)."""
        cfg = self.config

        def resid(w: int) -> np.ndarray:
            a = max(0, start - w)
            return residuals(X[a:], w)[start - a:]

        if member.endswith("_resid"):
            return resid(cfg.residual_window)
        if member.endswith("_joint"):
            return np.hstack([X[start:], resid(cfg.residual_window)])
        if member.endswith("_var"):
            a = max(0, start - cfg.var_lags)
            return X[start:] - (lagged(X[a:], cfg.var_lags) @ self.var_coef)[start - a:]
        if member.endswith("_level"):
            return np.hstack([resid(cfg.level_window), resid(cfg.residual_window)])
        return X[start:]

    def score(self, X: np.ndarray, last: int | None = None) -> np.ndarray:
        """Scores of the rows of ``X`` (in time order), or of its ``last`` rows only: the views still read
        every row before them, the models score those rows and the smoothing's warm-up
        (``ScorerConfig.warmup`` rows) alone, which is how the engine scores a node's newest rows cheaply."""
        X = self._scale(np.asarray(X, dtype=float))
        start = 0 if last is None else max(0, len(X) - last - self.config.warmup)
        total = np.zeros(len(X) - start)
        for full, m, (med, span) in zip(self.config.members, self.members, self.norms):
            total += (ewma(m.score(self._view(full, X, start)), self.config.span(full)) - med) / span
        return total if last is None else total[-last:]

    def contributions(self, x: np.ndarray) -> np.ndarray:
        """Per feature: (x - history median) / history 5-95 % range (signed)."""
        return (np.asarray(x, dtype=float) - self.center) / self.spread
