"""Node health: DCGM, compute and all-to-all preflight, baselines, bad-node isolation, history, reports.

One concept per module:
  result.py      CheckResult: one check's outcome (pass | warn | fail | unavailable)
  dcgm.py        `dcgmi diag -r N --fail-early -j`: parser, verdict, runner (+ dcgm_double.py, data/: test double)
  gpu_check.py   bf16 GEMM with a known answer + TFLOP/s + memory fill, per device
  alltoall.py    all_to_all_single bandwidth (algbw/busbw as nccl-tests) and #wrong; the per-rank worker
  baselines.py   stored baselines per (cluster, nodes, ranks/node, bytes, backend) and per GPU model; judging
  isolate.py     which node(s) made a group's all-to-all fail (binary splitting + anchor pairs); pure
  exec.py        health tasks on nodes: srun (argv from orchestrator/srun.py, the one srun builder), or the local
                 cluster's launcher (orchestrator/local_cluster.py)
  node_check.py  the per-node task (DCGM + compute)
  preflight.py   run_preflight(nodes, health_cfg, cluster_cfg, out_dir, run_name) -> PreflightResult
  store.py       per-cluster history (JSON lines) and quarantine
  report.py      rich table + report.html
  cli.py         moe-health preflight | baseline | report | release
"""
