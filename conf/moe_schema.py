"""`model.moe`: the MoE layer's settings (experts, routing and balancing, kernels, precision, dispatch, CUDA graphs).

Part of the typed configuration (conf/schema.py, which embeds it in ModelConfig and re-exports it); the same rules:
plain dataclasses, each `__post_init__` check names the dotted key and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_launch.conf.checks import one_of, require


@dataclass
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 256  # F: hidden size of each SwiGLU expert
    norm_topk_prob: bool = False  # OLMoE-1B-7B: False
    # how routing is kept balanced: aux_loss (Switch-style loss, weighted by aux_loss_coef) | aux_free_bias (a
    # per-expert bias learned from the load, added to the scores for selection only; no balancing loss) | sinkhorn
    # (selection by Sinkhorn-normalised scores; no balancing loss). The unweighted aux loss is reported for all three.
    balance: str = "aux_loss"
    aux_loss_coef: float = 1e-2  # Switch-style load balancing (balance=aux_loss only)
    bias_update_rate: float = 1e-3  # aux_free_bias: step of the bias towards the mean load after every optimizer step
    z_loss_coef: float = 1e-3  # router z-loss
    # auto (FastSparseMoE kernels for CUDA tensors, the torch reference elsewhere) | fast (kernels/) | reference
    impl: str = "auto"
    # bf16 | fp8: the expert GEMMs of the kernels' forward and activation gradients in FP8 e4m3 with fine-grained
    # scales (kernels/fp8.py; weight gradients stay bf16). Needs the kernels (impl auto or fast) on an sm90 GPU, and
    # model.d_model and expert_hidden multiples of FP8_DIM_MULTIPLE (checked in ModelConfig)
    precision: str = "bf16"
    # fp8: quantize each expert weight once per step rather than once per pass when a layer runs more than once in
    # a step (micro-batches, recomputed experts); the step holds each e4m3 copy (the weights' bf16 bytes again, over
    # all copies) until its last use in the step
    fp8_weight_reuse: bool = True
    # the kernels add each expert weight's gradient to the optimizer's gradient buffer inside the backward (in the
    # weight-gradient GEMM's epilogue on sm90) instead of returning it for autograd to add: one pass over the expert
    # gradients less per micro-batch. Off: autograd accumulates, as for every other parameter
    grad_accumulation_fusion: bool = True
    # the router's GEMMs with bf16 parameters: bf16 (tensor cores, fp32 accumulation; the logits come out fp32 and
    # equal the fp32 GEMM's, the backward rounds the logits' gradient to bf16 first) | fp32 (all three GEMMs in fp32
    # on the CUDA cores, several times slower). fp32 parameters always take fp32
    router_gemm: str = "bf16"
    # capture each layer's bf16 expert stage (forward and backward) as CUDA graphs and replay them
    # (kernels/moe_graph.py): a gain for few tokens per layer call (a couple of thousand at OLMoE dims), where queueing
    # the stage's ~45 kernels takes the host longer than the GPU takes to run them. Each layer holds its graphs'
    # memory pool (saved activations and temporaries) between steps, which grows with the tokens per call.
    # auto: graph the calls small enough to gain (moe_graph.AUTO_MAX_FLOPS), where the kernels run bf16 on a GPU and
    # the calls keep their shape from step to step (not the alltoall dispatcher at ep > 1); true: every call it can
    # (an error where it cannot: FP8, the reference experts); false: never
    cuda_graph: str = "auto"
    # the kernels' grouped GEMMs over rows (forward and activation gradients, bf16 and FP8): auto (per GEMM shape, our
    # persistent TMA kernel where it ran faster, 512-1024 rows per expert, else torch's CUTLASS one;
    # kernels/grouped_gemm_tma.py choose; in bf16 from 512 rows per expert with dims up to 2048 also gate+up with
    # SwiGLU as one GEMM and dx as one, kernels/swiglu_gemm.py choose) | torch (always CUTLASS, unfused) | tma (always
    # ours, fused in bf16). sm90; elsewhere our Triton one
    grouped_gemm: str = "auto"
    dispatcher: str = "allgather"  # EP token exchange: allgather (Optimus) | alltoall (Megatron)
    uniform_routing: bool = False  # forced uniform routing, for benchmarks only

    def __post_init__(self) -> None:
        require(self.num_experts >= 1, "model.moe.num_experts", f"got {self.num_experts}", "use at least 1 expert")
        require(
            1 <= self.top_k <= self.num_experts,
            "model.moe.top_k",
            f"got {self.top_k} with {self.num_experts} experts",
            "choose 1 <= top_k <= model.moe.num_experts",
        )
        require(self.expert_hidden >= 1, "model.moe.expert_hidden", f"got {self.expert_hidden}", "use a positive size")
        require(self.aux_loss_coef >= 0, "model.moe.aux_loss_coef", "is negative", "use a value >= 0 (e.g. 1e-2)")
        require(self.z_loss_coef >= 0, "model.moe.z_loss_coef", "is negative", "use a value >= 0 (e.g. 1e-3)")
        one_of(self.impl, ("auto", "reference", "fast"), "model.moe.impl")
        one_of(self.precision, ("bf16", "fp8"), "model.moe.precision")
        require(not (self.precision == "fp8" and self.impl == "reference"), "model.moe.precision",
                "fp8 runs in the FastSparseMoE kernels, but model.moe.impl=reference selects the plain-torch experts",
                "set model.moe.impl=fast (or auto), or model.moe.precision=bf16")
        one_of(self.router_gemm, ("bf16", "fp32"), "model.moe.router_gemm")
        self.cuda_graph = str(self.cuda_graph).lower()  # a Hydra override `=true` arrives as the bool's str
        one_of(self.cuda_graph, ("auto", "true", "false"), "model.moe.cuda_graph")
        require(not (self.cuda_graph == "true" and (self.impl == "reference" or self.precision != "bf16")),
                "model.moe.cuda_graph", f"graphs the bf16 FastSparseMoE kernels, but model.moe.impl={self.impl} and "
                f"model.moe.precision={self.precision}", "set model.moe.cuda_graph=auto or false, or impl=auto/fast "
                "with precision=bf16")
        one_of(self.grouped_gemm, ("auto", "torch", "tma"), "model.moe.grouped_gemm")
        one_of(self.dispatcher, ("allgather", "alltoall"), "model.moe.dispatcher")
        one_of(self.balance, ("aux_loss", "aux_free_bias", "sinkhorn"), "model.moe.balance")
        require(self.bias_update_rate > 0, "model.moe.bias_update_rate", f"got {self.bias_update_rate}",
                 "use a small positive step, e.g. 1e-3")

    @property
    def aux_loss_weight(self) -> float:
        """What the aux loss is multiplied by in the training loss: the other balancers do without it."""
        return self.aux_loss_coef if self.balance == "aux_loss" else 0.0
