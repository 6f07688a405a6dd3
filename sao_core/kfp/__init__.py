"""The Kubeflow Pipelines entry points: images, Kubernetes settings, compiling (with the UI dropdown
patch), the API client (upload, run, schedule) and local pipeline runs. The only place in `sao_core`
that imports `kfp`; the modules that do import it lazily or at the top of kfp-only modules."""
