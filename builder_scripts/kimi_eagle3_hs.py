"""Kimi-K2.5 (DeepSeek-V3 architecture: 61 layers, hidden 7168) EAGLE-3 hidden states, SGLang, TP=8.

Runs where the model and 8 GPUs are:

    hs-dataset build builder_scripts/kimi_eagle3_hs.py --output kimi-hs \\
        --set model=/models/Kimi-K2.5 --set source=/data/conversations.jsonl \\
        --push org/kimi-eagle3-hs --version v1.0

Per 2048-token sample: 4 states x 7168 x 2 bytes x 2048 tokens = 117 MB (the three aux layers
alone are 88 MB); writer batches are sized by bytes (HiddenStatesConfig.writer_batch_bytes): each
sample is its own Arrow record batch, written without a copy.
"""

CONFIG = {
    "model": "/models/Kimi-K2.5",  # a local directory: override with --set model=...
    "layers": [3, 31, 59],  # outputs of decoder layers 3, 31, 59 + the final post-norm state
    "max_length": 2048,
    "source": "conversations.jsonl",  # override with --set source=...
    "mask": "all",
    "truncation": "truncate",
    "backend": "sglang",
    "backend_options": {
        "tp_size": 8,
        "max_inflight": 64,
        "engine_args": {"mem_fraction_static": 0.85, "trust_remote_code": True},
    },
    "storage_dtype": "bfloat16",
    "part_size": 512,
    "max_shard_bytes": 4 * 2**30,
}
