"""Kimi-K2.5 (DeepSeek-V3 architecture: 61 layers, hidden 7168) EAGLE-3 hidden states, SGLang, TP=8.

Runs where the model and 8 GPUs are:

    hs-dataset build builder_scripts/kimi_eagle3_hs.py --output kimi-hs \\
        --set model=/models/Kimi-K2.5 --set source=/data/conversations.jsonl \\
        --push org/kimi-eagle3-hs --version v1.0

Kimi-K2.5's tokenizer is a tiktoken tokenizer in the model directory's own Python code
(tokenization_kimi.py, named by tokenizer_config.json's auto_map), and SGLang's Kimi-K2.5 processor is
too: trust_remote_code is on (the tokenizer, and the SGLang engine). Layers 3, 31, 59 (outputs of
those decoder layers) are what SGLang captures for an EAGLE-3 drafter whose config says
"eagle_aux_hidden_state_layer_ids": [4, 32, 60] (SGLang's id i = the state entering layer i); SGLang's
default without ids, [2, 30, 58], would be layers 1, 29, 57 here (README, "Build for a real model").

Per 2048-token sample: 4 states x 7168 x 2 bytes x 2048 tokens = 117 MB (the three aux layers
alone are 88 MB); writer batches are sized by bytes (HiddenStatesConfig.writer_batch_bytes): each
sample is its own Arrow record batch, written without a copy.
"""

CONFIG = {
    "model": "/models/Kimi-K2.5",  # a local directory: override with --set model=...
    "trust_remote_code": True,  # Kimi's tiktoken tokenizer and processor are the model directory's own code
    "layers": [3, 31, 59],  # outputs of decoder layers 3, 31, 59 + the final post-norm state
    "max_length": 2048,
    "source": "conversations.jsonl",  # override with --set source=...
    "mask": "all",
    "truncation": "truncate",
    "backend": "sglang",
    "backend_options": {
        "tp_size": 8,
        "max_inflight": 64,
        "engine_args": {"mem_fraction_static": 0.85},
    },
    "storage_dtype": "bfloat16",
    "part_size": 512,
}
