"""The Kubeflow Pipelines plumbing: Kubernetes settings, compiling (with the UI dropdown patch), the API client
(upload, run, schedule) and the local runner; what drives them by pipeline name is `pipelines/commands.py`,
the `make demo` run `sao_core/demo.py` (both above the pipelines). The only place in `sao_core`
that imports `kfp`; the modules that do import it lazily or at the top of kfp-only modules."""
