"""hs_dataset: versioned HuggingFace datasets of LLM hidden states for EAGLE-3 drafter training."""

__version__ = "0.1.0"
