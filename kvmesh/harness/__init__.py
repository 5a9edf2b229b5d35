"""The test harness: what tests, benchmarks and the demo start around kvmesh, one module per
job. The product never imports it (``kvmesh.router``, ``kvmesh.core``, ... run without it).

=============================  ==============================================================
``harness.ports``              :func:`free_port` (the one), :func:`wait_for_port`
``harness.processes``          :func:`spawn` / :func:`stop_process` (process groups, stopped
                               on exit), :class:`Service` (a child with a health check),
                               :func:`log_tail`, :func:`get_json`
``harness.replicas``           :class:`Replica`: a local vLLM OpenAI server with the PEERS.md
                               fairness settings; :func:`start_replicas`
``harness.events``             :class:`EventForwarder`: relays a replica's KV events
``harness.router``             :class:`RouterProcess`: the kvmesh router in its own process
``harness.services``           :class:`RedisServer`, :func:`shared_tier`, :func:`drop_page_cache`
``harness.connector``          :func:`connector_config`: a kvmesh replica's kv-transfer config
``harness.model``              :func:`make_tiny` / :func:`ensure_model`: random-weight Llamas
``harness.tokenizer``          :func:`train_bpe` (the one trainer), :func:`write_tokenizer_files`
=============================  ==============================================================

Import from the modules; this package root imports none of them (nothing heavy on import).
"""
