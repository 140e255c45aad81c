"""SGLang: the capture backend (:mod:`.backend`, over its own engine :mod:`.engine` or an attached server
:mod:`.attach`), the plugin SGLang loads (:mod:`.plugin`: the hooks; :mod:`.ring_copy`: the copies into
the ring), and what is known about SGLang versions (:mod:`.versions`).

Imports nothing: the plugin's modules run in SGLang's scheduler processes.
"""
