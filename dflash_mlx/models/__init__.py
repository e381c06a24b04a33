"""The models: the target (an mlx-lm model adapted for verifying blocks: hooks, batched rows,
cache rollback, per-instance class swaps, DeepSeek's sparse attention) and the drafters
(DFlash, DSpark) with their checkpoints, and loading them (local, hub, GGUF, under
`mlx.launch`). Grouped so what a forward computes sits apart from decode/, which decides
which forwards to run; the fast paths under them are in native/.
"""
