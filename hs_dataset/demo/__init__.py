"""Tiny random-weight models and tokenizers made locally (no download): the demo's Llama
(:mod:`.tiny`) and a Kimi-K2.5-packaged directory (:mod:`.tiny_kimi`), for the demo build and the tests."""
