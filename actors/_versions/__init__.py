"""Policy versions' pieces behind ``actors.policy_versions`` and ``actors.weight_subscriber``: the version
stores seen from a publisher (``storage``) and the ``policy_versions`` section of the manager's health
(``health``)."""
