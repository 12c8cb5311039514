"""The manager's pieces behind ``actors.manager.CheckpointManager``: its commit calls (``commits``), save
decisions (``decisions``), participants and liveness (``participants``), failures and recovery plans
(``recovery``), metrics (``metrics``) and the ``/healthz`` endpoint (``healthz``)."""
