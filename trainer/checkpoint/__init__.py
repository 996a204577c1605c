"""Dual alternating checkpoints (ckpt-a / ckpt-b), persistent model-only checkpoints (model-step-N), written
asynchronously, resumed under the same or another layout.

  layout.py    which rank writes / reads which file: stage, DP-scattered writes, EP-sharded experts
  state.py     the objects in those files (model parts, optimizer shard, RNG, trainer state); model loads across
               PP layouts
  store.py     atomic multi-rank directory writes, digests streamed while writing, manifest last; verify; slots
  snapshot.py  reusable (pinned) host buffers filled by non-blocking copies: the state at a step, off the GPU
  persist.py   AsyncCheckpointer: snapshot now, write in a background thread, one persist in flight
  manager.py   the trainer's side: slot choice, model checkpoints, journal records, stop on repeated write errors
  resume.py    which resume a layout change allows; the optimizer reassembled from other ranks' files
  reshard.py   which saved rank holds which optimizer shard under another DP size or sharding strategy

API for other code (e.g. a restore from host memory): `AsyncCheckpointer.request(step, targets, state)` captures
`state` ({relpath: tree of tensors}) into `snapshot.tree` (host tensors, complete after `snapshot.wait()`, valid
until the next request) and persists it; `wait()` returns the PersistResult once durable.
"""
