"""Training-step benchmark: our trainer's step against HF OlmoeForCausalLM, same shapes, same tokens.

Run on one GPU:   PYTHONUNBUFFERED=1 python benchmarks/train_step.py --out $OUT
CPU smoke test:   python benchmarks/train_step.py --smoke
Rows (ids for --only): our model with FastSparseMoE kernels, chunked head + cross-entropy and our sharded AdamW
(flat parameter/gradient buffers, one-pass Triton update) with bf16 parameters and the fp32 master inside the
optimizer ("bf16"), the same with attention + norms compiled ("bf16c"), with 4 micro-batches per optimizer step
("bf16c_acc4", 16 layers; "fp8c_acc4" the same with FP8 experts, sm90 only), fp32 parameters + bf16 autocast
("fp32"), and HF's model with experts_implementation grouped_mm (fp32 master + autocast, fused torch AdamW; "hf"),
at the 4-layer OLMoE shape (batch 4 x 4096) and the full 16-layer shape (batch 2 x 4096 per micro-batch).
MFU = (6*N_active + 6*L*d*S) * tokens / time over the device's data-sheet bf16 peak ("MFU spec", 989 TFLOP/s on
H100/H200) and over the dense bf16 GEMM rate measured in this run ("MFU dense"), with
N_active = L*(4d^2 + 3*K*d*F + d*E) + d*V (attention, the K active experts, router, output head; no input embedding;
trainer/tracking/flops.py, the count the trainer's own metrics use).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import time
import traceback

import torch
from device_idle import idle_gaps, sync_sites

from moe_launch.conf import presets
from moe_launch.conf.schema import ParallelConfig, TrainConfig
from moe_launch.kernels.fp8 import fp8_gemm_supported
from moe_launch.trainer.compile import compile_model
from moe_launch.trainer.dtypes import cast_parameters
from moe_launch.trainer.model import build_model
from moe_launch.trainer.model.loss import chunked_cross_entropy
from moe_launch.trainer.moe.layer import expert_weight_scope
from moe_launch.trainer.parallel.groups import build_groups
from moe_launch.trainer.parallel.optimizer import build_optimizer
from moe_launch.trainer.tracking.flops import flops_per_token, spec_peak


def dense_rate(device, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_steps(step_fn, device, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        step_fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step_fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def ours(model_cfg, batch_BS1, device, bf16_params: bool, phases: bool, accum: int = 1, compiled: bool = False,
         profile_dir=None):
    torch.manual_seed(0)
    model = build_model(model_cfg, device=device)
    if bf16_params:  # as train.param_dtype=bf16: parameters only; the fp32 master lives in the optimizer
        cast_parameters(model, torch.bfloat16)
    if compiled:  # as train.compile
        compile_model(model)
    groups = build_groups(ParallelConfig())
    opt = build_optimizer(model, TrainConfig(), ParallelConfig(), groups)
    use_autocast = device.type == "cuda" and not bf16_params
    inputs, targets = batch_BS1[:, :-1], batch_BS1[:, 1:]
    out = {}

    def fwd_bwd():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            loss, _ = model.compute_loss(inputs, targets)
        loss.backward()
        return loss

    weight_scope = expert_weight_scope(model_cfg, accum, [])  # FP8 experts: weights quantized once per step

    def step():
        with weight_scope():
            for _ in range(accum):  # micro-batches of the same tokens: the cost does not depend on the values
                loss = fwd_bwd()
        opt.reduce_grads()
        opt.clip_grad_norm_(1.0)
        opt.step(1e-4)
        opt.zero_grad()
        out["loss"] = loss

    times = timed_steps(step, device, warmup=2, iters=6 if device.type == "cuda" else 2)
    res = {"ms": 1e3 * sorted(times)[len(times) // 2], "loss": float(out["loss"]), "accum": accum,
           "compiled": compiled}
    if device.type == "cuda":
        res["peak_gib_step"] = torch.cuda.max_memory_allocated() / 2**30
        res["optimizer_memory_gib"] = opt.optimizer_memory_bytes() / 2**30
    if profile_dir:
        res["profile_top"] = profile_step(step, device, profile_dir)
    if phases:
        res["phases_ms"] = phase_breakdown(model, opt, inputs, targets, device, use_autocast)
    return res


def phase_breakdown(model, opt, inputs, targets, device, use_autocast) -> dict:
    """Each phase alone on the same activations: attention sublayer x L, MoE sublayer x L, head + CE, optimizer."""
    L = len(model.blocks)
    block = model.blocks[0]
    dt = torch.bfloat16 if use_autocast else model.lm_head.weight.dtype
    x = torch.randn(*inputs.shape, model.cfg.d_model, device=device, dtype=dt, requires_grad=True)

    def run(fn):
        def go():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                y = fn()
            y.float().sum().backward()
        return 1e3 * sorted(timed_steps(go, device, 2, 5))[2]

    attn = run(lambda: block.attn(block.attn_norm(x))) * L
    attn_backends = {}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                with sdpa_kernel([backend]):
                    attn_backends[f"attention[{name}]"] = run(lambda: block.attn(block.attn_norm(x))) * L
            except RuntimeError as e:
                attn_backends[f"attention[{name}]"] = f"unavailable: {str(e)[:80]}"
    moe = run(lambda: block.ffn(block.ffn_norm(x))[0]) * L
    head = run(lambda: chunked_cross_entropy(model.norm(x).flatten(0, 1), model.lm_head.weight, targets.flatten()))
    head_unfused = run(lambda: torch.nn.functional.cross_entropy(
        model.lm_head(model.norm(x)).float().flatten(0, 1), targets.flatten()))

    # correctness of the chunked head + CE against the unfused one on these activations (loss, dh, dW)
    got, want = {}, {}
    for store, fn in ((got, lambda h: chunked_cross_entropy(h.flatten(0, 1), model.lm_head.weight,
                                                            targets.flatten())),
                      (want, lambda h: torch.nn.functional.cross_entropy(
                          (h @ model.lm_head.weight.t()).float().flatten(0, 1), targets.flatten()))):
        h = model.norm(x).detach().requires_grad_()
        model.lm_head.weight.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
            loss = fn(h)
        loss.backward()
        store.update(loss=loss.detach().float(), dh=h.grad.float(), dw=model.lm_head.weight.grad.float())
    model.lm_head.weight.grad = None
    ce_err = {k: float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-30)) for k in got}
    opt.zero_grad()  # restores the parameters' gradient views

    def optim():  # the gradient buffers hold whatever the runs above left: the cost does not depend on values
        opt.reduce_grads()
        opt.clip_grad_norm_(1.0)
        opt.step(1e-4)
    opt_ms = 1e3 * sorted(timed_steps(optim, device, 1, 3))[1]
    opt.zero_grad()
    return {"attention": attn, **attn_backends, "moe": moe, "head+ce": head, "head+ce unfused": head_unfused,
            "optimizer": opt_ms, "ce_rel_err(loss,dh,dW)": ",".join(f"{ce_err[k]:.1e}" for k in ("loss", "dh", "dw"))}


def profile_step(step_fn, device, out_dir) -> list:
    """One step under the torch profiler: the top CUDA kernels by total time (and a chrome trace in out_dir)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_fn()
        sync(device)
    os.makedirs(out_dir, exist_ok=True)
    prof.export_chrome_trace(os.path.join(out_dir, "train_step_trace.json"))
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    with open(os.path.join(out_dir, "train_step_profile.txt"), "w") as f:
        f.write(table)
    top = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                 key=lambda e: -e.self_device_time_total)
    with open(os.path.join(out_dir, "train_step_kernels.json"), "w") as f:  # every kernel: self device ms, calls
        json.dump([(e.key, e.self_device_time_total / 1e3, e.count) for e in top], f, indent=0)
    idle = idle_gaps(os.path.join(out_dir, "train_step_trace.json"))
    sites = sync_sites(step_fn) if device.type == "cuda" else []
    with open(os.path.join(out_dir, "train_step_idle.json"), "w") as f:
        json.dump({"idle": idle, "sync_sites": sites}, f, indent=1)
    print(f"device idle in the profiled step: {idle['idle_ms']:.1f} of {idle['window_ms']:.1f} ms, "
          f"{idle['gaps']} gaps", flush=True)
    for c in idle["by_cause"]:
        print(f"  {c['ms']:8.2f} ms {c['gaps']:5d}  {c['cause']}", flush=True)
    for s in sites[:8]:
        print(f"host sync x{s['count']}:\n{s['stack']}", flush=True)
    return [(e.key[:60], round(e.self_device_time_total / 1e3, 2), e.count) for e in top[:25]]


def hf(model_cfg, batch_BS1, device):
    from transformers import OlmoeConfig, OlmoeForCausalLM

    m = model_cfg
    hcfg = OlmoeConfig(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.moe.expert_hidden,
                       num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
                       num_experts=m.moe.num_experts, num_experts_per_tok=m.moe.top_k, max_position_embeddings=4096,
                       norm_topk_prob=False, router_aux_loss_coef=m.moe.aux_loss_coef, output_router_logits=True,
                       attn_implementation="sdpa")
    hcfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    model = OlmoeForCausalLM(hcfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    out = {}

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=batch_BS1[:, :-1], labels=batch_BS1[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["loss"] = loss

    times = timed_steps(step, device, warmup=2, iters=5 if device.type == "cuda" else 2)
    res = {"ms": 1e3 * sorted(times)[len(times) // 2], "loss": float(out["loss"])}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run that checks the script")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="", help="comma list of row ids (bf16, bf16c, hf, ...) or shape/id")
    ap.add_argument("--profile", nargs="?", const="olmoe-4L/bf16", default=None, metavar="SHAPE/ID",
                    help="profile one step of that row (default olmoe-4L/bf16; needs --out)")
    ap.add_argument("--budget-s", type=float, default=75.0, help="skip the remaining rows after this many seconds")
    args = ap.parse_args()
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    base = presets.MODELS["olmoe_1b7b"]
    if args.smoke:
        shapes = [("smoke-2L", dataclasses.replace(base, n_layers=2, d_model=64, n_heads=4, vocab_size=512,
                                                   moe=dataclasses.replace(base.moe, num_experts=8, top_k=2,
                                                                           expert_hidden=32)), 2, 64)]
        rate = dense_rate(device, 256)
    else:
        shapes = [("olmoe-4L", dataclasses.replace(base, n_layers=4), 4, 4096),
                  ("olmoe-16L", base, 2, 4096)]
        rate = dense_rate(device, 8192)
    impl = "fast" if device.type == "cuda" else "reference"
    spec = spec_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None

    def prof(row: str):  # where that row's profile goes, if --profile named it
        return os.path.join(args.out, "profile") if args.out and args.profile == row else None

    four, sixteen = shapes[0], shapes[-1]
    # (id, shape, label, fn(model_cfg, batch) -> row): most informative first, so that --budget-s drops the least
    plan = [
        ("bf16", four, "ours: bf16 params + fp32 master (remainder) in optimizer",
         lambda m, batch: ours(m, batch, device, True, phases=True, profile_dir=prof("olmoe-4L/bf16"))),
        ("bf16c", four, "ours: bf16 params, attention + norms compiled",
         lambda m, batch: ours(m, batch, device, True, phases=False, compiled=True)),
        ("hf", four, "HF OlmoeForCausalLM grouped_mm", lambda m, batch: hf(m, batch, device)),
        ("bf16", sixteen, "ours: bf16 params + fp32 master (remainder) in optimizer",
         lambda m, batch: ours(m, batch, device, True, phases=True)),
        ("bf16c", sixteen, "ours: bf16 params, attention + norms compiled",
         lambda m, batch: ours(m, batch, device, True, phases=False, compiled=True)),
        ("hf", sixteen, "HF OlmoeForCausalLM grouped_mm", lambda m, batch: hf(m, batch, device)),
        ("bf16c_acc4", sixteen, "ours: bf16 params, compiled, 4 micro-batches per step",
         lambda m, batch: ours(m, batch, device, True, phases=False, compiled=True, accum=4,
                               profile_dir=prof(f"{sixteen[0]}/bf16c_acc4"))),
        ("fp32", four, "ours: fp32 params + autocast",
         lambda m, batch: ours(m, batch, device, bf16_params=False, phases=False)),
    ]
    if fp8_gemm_supported(device):
        for shape in (sixteen, four):  # the 4-layer shape fits an 80 GB card: its profile shows the per-layer costs
            plan.append(("fp8c_acc4", shape, "ours: FP8 experts, bf16 params, compiled, 4 micro-batches per step",
                         lambda m, batch, shape=shape: ours(
                             dataclasses.replace(m, moe=dataclasses.replace(m.moe, precision="fp8")), batch, device,
                             True, phases=False, compiled=True, accum=4, profile_dir=prof(f"{shape[0]}/fp8c_acc4"))))
    rows = []
    only = set(filter(None, args.only.split(",")))
    for row_id, (shape_name, m, B, S), name, fn in plan:
        m = dataclasses.replace(m, moe=dataclasses.replace(m.moe, impl=impl))
        torch.manual_seed(1)
        batch = torch.randint(0, m.vocab_size, (B, S + 1), device=device)
        fpt = flops_per_token(m, S)
        if only and row_id not in only and f"{shape_name}/{row_id}" not in only:
            continue
        if time.perf_counter() - t_start > args.budget_s:
            print(f"skipped {shape_name} / {name}: past --budget-s", flush=True)
            continue
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t_row = time.perf_counter()
        try:
            r = fn(m, batch)
        except Exception as e:  # an OOM on one row must not cost the others
            traceback.print_exc()
            r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        if "ms" in r:
            tokens = B * S * r.get("accum", 1)
            r["tokens_per_s"] = tokens / (r["ms"] / 1e3)
            r["mfu"] = fpt * r["tokens_per_s"] / rate
            r["mfu_spec"] = fpt * r["tokens_per_s"] / spec if spec else None
        if device.type == "cuda":
            r["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        r.update(id=row_id, shape=shape_name, row=name, batch=B, seq=S, row_s=round(time.perf_counter() - t_row, 1))
        rows.append(r)
        print(json.dumps(r), flush=True)
        write_json(args.out, device, rate, rows)  # after every row: a timeout keeps what was measured
    meta = write_json(args.out, device, rate, rows)
    print(f"\n{meta}")
    for r in rows:
        if r.get("profile_top"):
            print(f"\nprofile of {r['shape']}/{r['id']} (self CUDA ms, calls):")
            for key, ms, n in r["profile_top"]:
                print(f"  {ms:8.2f} {n:5d}  {key}")
    print(f"\n{'shape':10s} {'id':11s} {'ms':>8s} {'tok/s':>9s} {'MFU spec':>8s} {'MFU dense':>9s} {'GiB':>6s}  phases")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:10s} {r['id']:11s} ERROR {r['error']}")
            continue
        ph = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in r.get("phases_ms", {}).items())
        mfu_spec = f"{100 * r['mfu_spec']:7.1f}%" if r.get("mfu_spec") else f"{'-':>8s}"
        print(f"{r['shape']:10s} {r['id']:11s} {r['ms']:8.1f} {r['tokens_per_s']:9.0f} {mfu_spec} "
              f"{100 * r['mfu']:8.1f}% {r.get('peak_gib', 0):6.1f}  {ph}")


def write_json(out_dir, device, rate, rows) -> dict:
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
            "dense_tflops": rate / 1e12}
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "train_step.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return meta


if __name__ == "__main__":
    main()
