"""Multi-node SAO on Kubernetes: one Kubeflow Trainer TrainJob with rollout replicas and a torchrun learner.

- :mod:`sao_core.cluster.manifests`: the ``sao-rl`` (Cluster)TrainingRuntime and TrainJob manifests
  (:class:`~sao_core.cluster.manifests.RuntimeSpec`, :func:`~sao_core.cluster.manifests.runtime_manifest`,
  :func:`~sao_core.cluster.manifests.trainjob_manifest`), the one source of the files under ``deploy/``;
- :mod:`sao_core.cluster.golden`: the generated files shipped under ``deploy/`` (``sao cluster render``);
- :mod:`sao_core.cluster.schema`: validation against the official Trainer CRDs (tests, ``--check``);
- :mod:`sao_core.cluster.api`: the Kubernetes API calls (python ``kubernetes`` client), clear errors;
- :mod:`sao_core.cluster.launcher`: :func:`~sao_core.cluster.launcher.launch` (create, follow, return the
  final model; delete on timeout / cancellation) and :func:`~sao_core.cluster.launcher.delete_trainjob`;
- :mod:`sao_core.cluster.entry`: what the pods run (``sao cluster learner`` / ``sao cluster rollout``);
- :mod:`sao_core.cluster.names`: TrainJob names and the rollout replicas' DNS names
  (:func:`~sao_core.cluster.names.rollout_urls`, :func:`~sao_core.cluster.names.rollout_urls_from_env`).

See ``deploy/README.md`` for installing the runtime, RBAC, the Kueue queue and the S3 secret.
"""
