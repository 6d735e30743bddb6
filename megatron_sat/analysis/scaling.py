"""Scaling-law fits of a sweep: L(x) = E + A * x^(-alpha), x = parameters or training FLOPs, and the compute
multiplier of an arch against the Transformer.

fit_power_law(x, y)           least squares with scipy (curve_fit, bounded: 0 <= E < min(y), A > 0,
                              0 < alpha <= 4), in x / x0 with x0 the geometric mean of x (so that A's scale
                              does not matter); initial guesses from the data: for E on a grid below min(y),
                              log(y - E) against log x is a straight line, the best one gives A and alpha.
                              Needs 3 distinct x (3 parameters): FitError says so otherwise.
fit_with_bootstrap(points)    points {x: [loss per seed]}: the fit of the per-x means, and when some x has 2 or
                              more seeds, the spread of E, A, alpha over fits of seed resamples (each x's seeds
                              drawn with replacement, `samples` times, fixed RNG seed): sd and 16/84 percentiles.
compute_to_reach(fit, L)      the compute at which a fitted curve reaches loss L (inf at or below its E).
multiplier_from_fits(f, t, C) how much more Transformer compute reaches the loss arch f has at compute C:
                              compute_to_reach(t, f(C)) / C. > 1: the arch is worth that much more compute.
multiplier_interval(f, t, C)  its percentile interval over the paired bootstrap draws of both fits (seeds
                              resampled per scale): the spread that seed noise gives the fits; with 2-3 seeds
                              per scale it is narrower than the truth (a bootstrap of 3 values), so read it as
                              a lower bound on the uncertainty, not a calibrated 95 % interval.
multiplier_measured(...)      the same from measured points: the Transformer's (C, L) means interpolated
                              linearly in log C against log L (extrapolated beyond its points: flagged).
"""

import math
import warnings
from typing import Dict, List, Optional, Sequence

import numpy as np

ALPHA_MAX = 4.0


class FitError(ValueError):
    pass


def _model(u, E, b, alpha):
    return E + np.exp(b) * np.power(u, -alpha)


def _initial_guess(u: np.ndarray, y: np.ndarray):
    best = None
    for E in np.linspace(0.0, 0.99 * y.min(), 40):
        slope, b = np.polyfit(np.log(u), np.log(y - E), 1)
        alpha = min(max(-slope, 1e-3), ALPHA_MAX - 1e-3)
        err = float(np.sum((_model(u, E, b, alpha) - y) ** 2))
        if best is None or err < best[0]:
            best = (err, E, b, alpha)
    return best[1:]


def fit_power_law(x: Sequence[float], y: Sequence[float]) -> dict:
    """{E, A, alpha, x0, rmse, n}: L = E + A * x^-alpha fitted to the points (x, y); FitError below 3 distinct x."""
    from scipy.optimize import curve_fit  # optional (eval extra), slow to import: only when a fit is made

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(set(x.tolist())) < 3:
        raise FitError(f"{len(set(x.tolist()))} scale(s): 3 or more are needed to fit E, A and alpha")
    if np.any(x <= 0) or np.any(~np.isfinite(y)) or np.any(y <= 0):
        raise FitError("x must be positive and losses finite and positive")
    x0 = float(np.exp(np.mean(np.log(x))))
    u = x / x0
    E0, b0, a0 = _initial_guess(u, y)
    upper_E = float(y.min()) * (1 - 1e-9)
    p0 = [min(max(E0, 0.0), upper_E * (1 - 1e-6)), b0, a0]
    try:
        with warnings.catch_warnings():  # 3 points for 3 parameters leave no covariance; the spread comes from
            warnings.simplefilter("ignore")  # the bootstrap over seeds instead
            (E, b, alpha), _ = curve_fit(_model, u, y, p0=p0, bounds=([0.0, -50.0, 1e-6], [upper_E, 50.0, ALPHA_MAX]),
                                         method="trf", maxfev=20000, xtol=1e-15, ftol=1e-15, gtol=1e-15)
    except (RuntimeError, ValueError) as e:
        raise FitError(f"the fit did not converge: {e}") from None
    residual = _model(u, E, b, alpha) - y
    return dict(E=float(E), A=float(math.exp(b) * x0 ** alpha), alpha=float(alpha), x0=x0,
                rmse=float(np.sqrt(np.mean(residual ** 2))), n=int(len(x)),
                at_bound=[name for name, v, lo, hi in (("E", E, 0.0, upper_E), ("alpha", alpha, 1e-6, ALPHA_MAX))
                          if abs(v - lo) < 1e-9 * max(1.0, abs(lo)) or abs(v - hi) < 1e-9 * max(1.0, abs(hi))])


def predict(fit: dict, x) -> np.ndarray:
    return fit["E"] + fit["A"] * np.power(np.asarray(x, dtype=np.float64), -fit["alpha"])


def fit_with_bootstrap(points: Dict[float, List[float]], samples: int = 1000, seed: int = 0) -> dict:
    """The fit of the per-x means; with 2+ seeds at some x, 'bootstrap': {param: {sd, p16, p84}} and 'draws'
    (the resampled fits, for the multiplier's spread). FitError when the means cannot be fitted."""
    xs = sorted(points)
    fit = fit_power_law(xs, [float(np.mean(points[x])) for x in xs])
    seeds = max(len(points[x]) for x in xs)
    fit["seeds"] = {str(x): len(points[x]) for x in xs}
    if seeds < 2:
        fit["bootstrap"] = None
        fit["bootstrap_note"] = "one seed per scale: no bootstrap"
        return fit
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(samples):
        means = [float(np.mean(rng.choice(points[x], size=len(points[x]), replace=True))) for x in xs]
        try:
            draws.append(fit_power_law(xs, means))
        except FitError:
            continue
    fit["bootstrap"] = {
        key: dict(sd=float(np.std([d[key] for d in draws], ddof=1)),
                  p16=float(np.percentile([d[key] for d in draws], 16)),
                  p84=float(np.percentile([d[key] for d in draws], 84)))
        for key in ("E", "A", "alpha")} if len(draws) > 1 else None
    fit["bootstrap_samples"] = len(draws)
    fit["draws"] = [{k: d[k] for k in ("E", "A", "alpha")} for d in draws]
    return fit


def compute_to_reach(fit: dict, loss: float) -> float:
    """x at which E + A x^-alpha = loss (inf when loss <= E: the curve never gets there)."""
    if loss <= fit["E"]:
        return math.inf
    return (fit["A"] / (loss - fit["E"])) ** (1.0 / fit["alpha"])


def multiplier_from_fits(fit: dict, reference: dict, compute: float) -> float:
    """Reference (Transformer) compute that reaches the loss `fit` has at `compute`, divided by `compute`."""
    return compute_to_reach(reference, float(predict(fit, compute))) / compute


def multiplier_spread(fit: dict, reference: dict, compute: float) -> Optional[float]:
    """sd of the multiplier over paired bootstrap draws of the two fits (None without draws)."""
    a, b = fit.get("draws") or [], reference.get("draws") or []
    n = min(len(a), len(b))
    if n < 2:
        return None
    values = [multiplier_from_fits(a[i], b[i], compute) for i in range(n)]
    values = [v for v in values if math.isfinite(v)]
    return float(np.std(values, ddof=1)) if len(values) > 1 else None


def multiplier_interval(fit: dict, reference: dict, compute: float, level: float = 0.95) -> Optional[list]:
    """[low, high]: the central `level` share of the multiplier over paired bootstrap draws of the two fits
    (order statistics, so an infinite draw - the arch's loss below the Transformer's fitted E - gives an
    infinite bound rather than an error); None without draws."""
    a, b = fit.get("draws") or [], reference.get("draws") or []
    n = min(len(a), len(b))
    if n < 2:
        return None
    values = sorted(multiplier_from_fits(a[i], b[i], compute) for i in range(n))
    tail = (1.0 - level) / 2.0
    return [float(values[int(math.floor(tail * (n - 1)))]), float(values[int(math.ceil((1.0 - tail) * (n - 1)))])]


def multiplier_measured(reference_points: Sequence[tuple], loss: float, compute: float):
    """(multiplier, extrapolated) from the reference's measured (compute, loss) means: log L against log C,
    piecewise linear; (None, False) with fewer than 2 reference points or a flat reference curve."""
    pts = sorted((c, loss_) for c, loss_ in reference_points if c > 0 and loss_ > 0)
    if len(pts) < 2:
        return None, False
    logc = [math.log(c) for c, _ in pts]
    logl = [math.log(loss_) for _, loss_ in pts]
    target = math.log(loss)
    # the segment whose loss range holds the target, else the end segment on that side
    for i in range(len(pts) - 1):
        lo, hi = sorted((logl[i], logl[i + 1]))
        if lo <= target <= hi and logl[i] != logl[i + 1]:
            j, extrapolated = i, False
            break
    else:
        j = 0 if target > max(logl) else len(pts) - 2
        extrapolated = True
        if logl[j] == logl[j + 1]:
            return None, True
    t = (target - logl[j]) / (logl[j + 1] - logl[j])
    c_ref = math.exp(logc[j] + t * (logc[j + 1] - logc[j]))
    return c_ref / compute, extrapolated
