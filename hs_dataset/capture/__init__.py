"""Stage 2, capture: token ids -> hidden states of the configured layers and the final post-norm state.

* :mod:`.base`: the backend protocol; :mod:`.backends` starts one by name (:mod:`.registry`,
  :mod:`.options`: the options each takes, read from its signature);
* :mod:`.transformers`: the reference backend (HF transformers, any device);
* :mod:`.isolated` (+ :mod:`.isolated_child`): any backend in a child process, its death or hang an error;
* :mod:`.sglang`: the SGLang backend and its plugin; :mod:`.transport`: the shared-memory ring
  between them.

This package's ``__init__`` imports nothing: the SGLang plugin loads its modules in SGLang's
scheduler processes.
"""
