"""The CPU audit of every SGLang release hs_dataset supports (tests/sglang_audit/touchpoints.py)."""
