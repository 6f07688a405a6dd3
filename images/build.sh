#!/usr/bin/env bash
# Build one of the images with docker or buildah.
#
#   images/build.sh KIND [--tag REF] [--debian-base] [--wheels DIR] [--engine docker|buildah]
#
# KIND: cpu | train | rollout (images/cpu.Dockerfile, cuda.Dockerfile, vllm.Dockerfile).
# --tag          image reference [default: what sao_core.kfp.images.image(KIND) says, i.e. SAO_IMAGE_*]
# --debian-base  build FROM a Debian bookworm root made with debootstrap (no registry needed), imported
#                once as localhost/debian-base:bookworm (buildah only)
# --wheels DIR   a folder of wheels (e.g. the CPU torch wheel) mounted at /wheels and used as
#                --find-links; PyTorch's index is then not used (cpu only)
# PIP_CERT in the environment (a CA bundle file) is mounted into the build for pip, for networks that
# re-sign TLS; the Dockerfiles stay the same for everyone else.
set -euo pipefail
cd "$(dirname "$0")/.."

kind="${1:-}"; shift || true
case "$kind" in
  cpu) dockerfile=images/cpu.Dockerfile ;;
  train) dockerfile=images/cuda.Dockerfile ;;
  rollout) dockerfile=images/vllm.Dockerfile ;;
  *) echo "usage: images/build.sh cpu|train|rollout [--tag REF] [--debian-base] [--wheels DIR] [--engine E]" >&2; exit 2 ;;
esac
tag="" debian_base=0 wheels="" engine=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag="$2"; shift 2 ;;
    --debian-base) debian_base=1; shift ;;
    --wheels) wheels="$(cd "$2" && pwd)"; shift 2 ;;
    --engine) engine="$2"; shift 2 ;;
    *) echo "images/build.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
if [ -z "$tag" ]; then
  tag="$("$python" -c "from sao_core.kfp.images import image; print(image('$kind'))")"
fi
if [ -z "$engine" ]; then
  if command -v buildah >/dev/null 2>&1; then engine=buildah
  elif docker info >/dev/null 2>&1; then engine=docker
  else echo "images/build.sh: neither buildah nor a running docker engine found" >&2; exit 2; fi
fi

args=(-f "$dockerfile" -t "$tag")
volumes=()
if [ "$debian_base" = 1 ]; then
  [ "$engine" = buildah ] || { echo "--debian-base needs buildah" >&2; exit 2; }
  base=localhost/debian-base:bookworm
  if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
    mirror="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
    mirror="${mirror:-http://deb.debian.org/debian}"
    root="$(mktemp -d)"
    echo "debootstrap bookworm from $mirror into $root" >&2
    debootstrap --variant=minbase bookworm "$root" "$mirror" >/dev/null
    container="$(buildah from scratch)"
    mount="$(buildah mount "$container")"
    tar -C "$root" -c . | tar -C "$mount" -x
    buildah umount "$container" >/dev/null
    buildah commit --quiet "$container" "$base" >/dev/null
    buildah rm "$container" >/dev/null
    rm -rf "$root"
  fi
  args+=(--build-arg "BASE=$base")
fi
if [ -n "$wheels" ]; then
  volumes+=(-v "$wheels:/wheels:ro")
  args+=(--build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_INDEX=)
fi
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
  volumes+=(-v "$(dirname "$PIP_CERT"):/hostcerts:ro")
  args+=(--build-arg "PIP_CERT=/hostcerts/$(basename "$PIP_CERT")")
fi
echo "building $tag from $dockerfile with $engine" >&2
if [ "$engine" = buildah ]; then
  buildah bud --isolation chroot --layers "${volumes[@]}" "${args[@]}" .
else
  [ ${#volumes[@]} -eq 0 ] || { echo "--wheels and PIP_CERT mounts need buildah" >&2; exit 2; }
  docker build "${args[@]}" .
fi
echo "$tag"
