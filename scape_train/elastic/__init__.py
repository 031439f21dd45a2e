"""Elastic local-step training (DiLoCo, GASLoC, SparseLoCo): workers that come and go without
stopping the job (torchft).

Each worker is one process and one torchft replica group; a lighthouse decides, round by round,
which workers take part (the quorum). Turned on with ``strategy.elastic.enabled=true``
(``optim/local/config.py``: ``ElasticConfig``); torchft is imported only then.

    python -m scape_train.elastic lighthouse --port 29510          # once, anywhere reachable
    python -m scape_train strategy=diloco strategy.elastic.enabled=true \\
        strategy.elastic.lighthouse=http://localhost:29510 strategy.elastic.slots=3 \\
        strategy.elastic.replica=0 run_dir=outputs/elastic/r0      # one per worker

``replica.py``: a worker's Manager, its quorum log and its data cursor; ``lighthouse.py``: the
lighthouse command. The commit rule (a round is applied only where every participant voted for
it) is in ``optim/local/outer.py``; the collectives across workers in ``comm.ReplicaComm``.
"""
