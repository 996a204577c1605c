"""The variant comparisons of benchmarks/loss_curve.py: does a variant of the bf16 recipe learn like it, within the
bf16 run's run-to-run noise? `--compare precision`: the FP8 expert path (model.moe.precision=fp8, run "fp8");
`--compare router`: the router's GEMMs in fp32 (model.moe.router_gemm=fp32, run "router_fp32") against the default
bf16 tensor-core GEMMs. Written below for fp8; the router comparison is the same with its run in fp8's place.

Three runs of the real Trainer, model.moe.impl=fast and train.dtype=bf16 for all, 500 steps by default:
  bf16     precision=bf16, init seed A
  bf16_b   precision=bf16, init seed B: the run-to-run noise yardstick
  fp8      precision=fp8,  init seed A
all on the same data order. 500 steps of global batch 16 read 3.7 epochs of the built-in corpus (2,271 sequences,
less the 128 held out below), each epoch in its own order: from the second epoch on the sequences repeat, so the
tail of the curve partly measures memorisation, alike for all three runs.

Why a separate init seed: train.seed (A: 1234, or --seed) seeds both the initial weights (torch.manual_seed before
the model is built, trainer/loop.py) and the data order (TokenLoader's per-epoch permutation key,
trainer/data/loader.py); data.seed only shuffles the built-in corpus at tokenization time, so changing it changes
the dataset itself. Neither setting varies the init alone. Nothing in training draws from torch's global generator
after the build (no dropout, no router noise), so the init is the only random input besides the data. The bf16_b run
therefore keeps train.seed=A (identical batches, step for step) and is handed the model the Trainer would build
under seed B (trainer/standby.py warm_model: same build, cast and compile path, one forward/backward on made-up
tokens, no weight change). Two bf16 runs that differ only in their init are the yardstick: their per-step gap is
what an honest rerun of the bf16 recipe with a new seed moves the curve by, with the data held fixed.

Verdict rule, over the last --window steps: "fp8 within bf16 run-to-run noise: yes" when
mean |fp8 - bf16| <= mean |bf16_b - bf16| (factor 1, no floor: the yardstick is already the full seed spread).
The fp8 run shares bf16's init, so its gap starts at 0 while the seed gap starts at the init spread; the window is the
tail of the run, hundreds of steps later, but as far as the two same-init trajectories stay correlated there, the
rule leans in fp8's favour. A systematic FP8 penalty still shows in the signed means (fp8 - bf16 and
bf16_b - bf16: positive = higher loss than bf16), which the table prints beside the rule; the smoothed
figures (trailing mean over --smooth steps of each curve first) take out the per-batch jitter of the differences.

Held-out loss: with the corpus repeated, a lower training loss may be faster memorisation rather than better
learning. loss_curve.py therefore sets --holdout sequences aside (never trained on) and has the trainer evaluate on
them every --eval-every steps (data.eval_path, train.eval_interval); the final model's held-out loss is compared the
same way, |fp8 - bf16| against |bf16_b - bf16|, on a second line beside the rule's verdict (one number per run: a
coarser yardstick than the curves' window; every evaluation is in the JSON).

Smoke mode (CPU, fp32): FP8 needs an sm90 GPU, so the fp8 slot runs precision=bf16 as a plumbing check of the
script (its gap to bf16 is 0), labelled as such; no verdict.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

from moe_launch.conf.schema import RootConfig

SEED_A = 1234  # the default A: train.seed of every run (the data order); B = A + 1 only inits bf16_b
VARIANTS = {"precision": "fp8", "router": "router_fp32"}  # --compare mode -> the variant run's name


def rule(variant: str = "fp8") -> str:
    return f"mean |{variant} - bf16| <= mean |bf16_b - bf16| over the last window steps"


RULE = rule()


class PrecisionRun(NamedTuple):
    name: str
    cfg: RootConfig
    init_seed: int  # the seed the initial weights come from; the data order always follows cfg.train.seed
    label: str  # precision as run, for the printed lines and the JSON


def plan(smoke: bool, make_cfg: Callable[[str], RootConfig], seed_a: int = SEED_A,
         variant: str = "fp8") -> list[PrecisionRun]:
    """The three runs. `make_cfg(setting)` gives loss_curve's RootConfig (impl fast) for "bf16" (the default recipe)
    or the variant's name; train.seed is set to A in all three (another A: another data order and other inits, a
    repeat of the whole comparison)."""
    # CPU: FP8 cannot run, so its slot checks the script's plumbing only (router_fp32 runs: CPU parameters are fp32,
    # whose router takes the fp32 GEMMs in every run)
    stand_in = smoke and variant == "fp8"
    runs = []
    for name, setting, init_seed in (("bf16", "bf16", seed_a), ("bf16_b", "bf16", seed_a + 1),
                                     (variant, "bf16" if stand_in else variant, seed_a)):
        cfg = make_cfg(setting)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed_a))
        label = "bf16 (stand-in for fp8: CPU smoke)" if name == "fp8" and stand_in else setting
        runs.append(PrecisionRun(name, cfg, init_seed, label))
    return runs


def _smoothed(curve: list[float], k: int) -> list[float]:
    """Trailing mean over the last k steps (fewer at the start)."""
    out, total = [], 0.0
    for i, x in enumerate(curve):
        total += x
        if i >= k:
            total -= curve[i - k]
        out.append(total / min(i + 1, k))
    return out


def _diff_stats(a: list[float], b: list[float], lo: int, hi: int) -> dict:
    d = [x - y for x, y in zip(a[lo:hi], b[lo:hi])]
    n = max(1, len(d))
    return {"mean_abs": sum(abs(x) for x in d) / n, "max_abs": max((abs(x) for x in d), default=0.0),
            "signed_mean": sum(d) / n}


def summarize(curves: dict[str, list[float]], rates: dict[str, float | None], window: int, smooth: int,
              verdict: bool, heldout: dict[str, float] | None = None, variant: str = "fp8") -> dict:
    """Pure: the variant (fp8) against bf16 (the gap) and bf16_b against bf16 (the noise) over the last `window`
    steps, raw and after a trailing mean of `smooth` steps; `rates` are the runs' median tokens/s; `heldout` the
    final models' held-out losses, compared the same way."""
    v = variant
    bf16, bf16_b, var = curves["bf16"], curves["bf16_b"], curves[v]
    n = min(len(bf16), len(bf16_b), len(var))
    w = min(window, n)
    gap, noise = _diff_stats(var, bf16, n - w, n), _diff_stats(bf16_b, bf16, n - w, n)
    sm = {name: _smoothed(c[:n], smooth) for name, c in curves.items()}
    sm_gap = _diff_stats(sm[v], sm["bf16"], n - w, n)
    sm_noise = _diff_stats(sm["bf16_b"], sm["bf16"], n - w, n)
    out = {
        "steps": n, "window": w, "smooth": smooth, "rule": rule(v), "variant": v,
        f"gap_mean_abs_{v}_vs_bf16": gap["mean_abs"],
        "noise_mean_abs_bf16_b_vs_bf16": noise["mean_abs"],
        f"gap_max_abs_{v}_vs_bf16": gap["max_abs"],
        "noise_max_abs_bf16_b_vs_bf16": noise["max_abs"],
        f"gap_signed_mean_{v}_minus_bf16": gap["signed_mean"],
        "noise_signed_mean_bf16_b_minus_bf16": noise["signed_mean"],
        "gap_over_noise": gap["mean_abs"] / noise["mean_abs"] if noise["mean_abs"] > 0 else None,
        "smoothed_gap_mean_abs": sm_gap["mean_abs"],
        "smoothed_noise_mean_abs": sm_noise["mean_abs"],
        "smoothed_gap_signed_mean": sm_gap["signed_mean"],
        "smoothed_noise_signed_mean": sm_noise["signed_mean"],
        "max_abs_all_steps": {f"{v}_vs_bf16": _diff_stats(var, bf16, 0, n)["max_abs"],
                              "bf16_b_vs_bf16": _diff_stats(bf16_b, bf16, 0, n)["max_abs"]},
        "final": {name: c[n - 1] for name, c in curves.items()},
        "first": {name: c[0] for name, c in curves.items()},
        "median_tokens_per_s": dict(rates),
        f"{v}_speed_vs_bf16": (rates[v] / rates["bf16"]) if rates.get(v) and rates.get("bf16") else None,
    }
    if heldout is not None:
        out["heldout_lm_loss"] = dict(heldout)
        out[f"heldout_gap_{v}_minus_bf16"] = heldout[v] - heldout["bf16"]
        out["heldout_noise_bf16_b_minus_bf16"] = heldout["bf16_b"] - heldout["bf16"]
        if verdict:
            out["heldout_within_bf16_noise"] = (abs(out[f"heldout_gap_{v}_minus_bf16"])
                                                <= abs(out["heldout_noise_bf16_b_minus_bf16"]))
    if verdict:
        out["within_bf16_noise"] = gap["mean_abs"] <= noise["mean_abs"]
        out["verdict"] = f"{v} within bf16 run-to-run noise: {'yes' if out['within_bf16_noise'] else 'no'}"
    else:
        out["verdict"] = f"smoke run (CPU, fp32; the {v} slot ran as a plumbing check): no verdict"
    return out


def table(s: dict) -> str:
    """The summary as printed last: one row per pair, one per run, then the verdict."""
    v = s.get("variant", "fp8")
    rows = [f"last {s['window']} of {s['steps']} steps (smoothed: trailing mean of {s['smooth']})",
            f"{'pair':22s} {'mean|d|':>9s} {'max|d|':>9s} {'mean d':>9s} {'smooth mean|d|':>15s}",
            f"{'gap   ' + v + ' - bf16':22s} {s[f'gap_mean_abs_{v}_vs_bf16']:9.4f} "
            f"{s[f'gap_max_abs_{v}_vs_bf16']:9.4f} {s[f'gap_signed_mean_{v}_minus_bf16']:+9.4f} "
            f"{s['smoothed_gap_mean_abs']:15.4f}",
            f"{'noise bf16_b - bf16':22s} {s['noise_mean_abs_bf16_b_vs_bf16']:9.4f} "
            f"{s['noise_max_abs_bf16_b_vs_bf16']:9.4f} {s['noise_signed_mean_bf16_b_minus_bf16']:+9.4f} "
            f"{s['smoothed_noise_mean_abs']:15.4f}",
            f"{'run':11s} {'first':>8s} {'final':>8s} {'tokens/s':>10s}"]
    for name in ("bf16", "bf16_b", v):
        rate = s["median_tokens_per_s"].get(name)
        rows.append(f"{name:11s} {s['first'][name]:8.4f} {s['final'][name]:8.4f} "
                    f"{rate if rate is not None else float('nan'):10.0f}")
    ratio, speed = s["gap_over_noise"], s[f"{v}_speed_vs_bf16"]
    rows.append(f"gap / noise {ratio:.2f}" if ratio is not None else "gap / noise: n/a (noise 0)")
    rows.append(f"{v} tokens/s vs bf16 {speed:.2f}x" if speed is not None else f"{v} tokens/s vs bf16: n/a")
    if "heldout_lm_loss" in s:
        h = s["heldout_lm_loss"]
        line = (f"held-out loss: bf16 {h['bf16']:.4f}, bf16_b {h['bf16_b']:.4f}, {v} {h[v]:.4f}; {v} - bf16 "
                f"{s[f'heldout_gap_{v}_minus_bf16']:+.4f}, bf16_b - bf16 {s['heldout_noise_bf16_b_minus_bf16']:+.4f}")
        if "heldout_within_bf16_noise" in s:
            line += f"; within: {'yes' if s['heldout_within_bf16_noise'] else 'no'}"
        rows.append(line)
    rows.append(f"rule: {s['rule']}")
    rows.append(s["verdict"])
    return "\n".join(rows)
