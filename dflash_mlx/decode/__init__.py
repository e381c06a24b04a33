"""Decoding: how replies are generated once the models are loaded. The scheduler runs
replies cycle by cycle (alone or batched into one verify forward), a cycle drafts,
verifies and accepts, and around it sit what proposes the drafts (the drafter, the
prompt lookup, trees, the adaptive choice of their sizes), the sampling rules that
keep the output exactly the target's, stop strings, and the prompt caches kept across
calls and on disk. It drives models/ and is driven by the library's `generate`, the
CLI and the server; keeping it apart keeps the speed-critical loop in one place.
"""
