#!/usr/bin/env bash
# Build, check and describe the vramguard image (the Makefile's `image`, `image-check` targets).
#
#   scripts/image.sh build    build $IMAGE from the Dockerfile
#   scripts/image.sh check    verify the built image (non-root, read-only root, --help of every
#                             command, no compiler or pip, SBOM, size breakdown)
#   scripts/image.sh env      print the environment the e2e tests need to run the image
#
# The engine is docker when a Docker daemon answers, else podman (CONTAINER_ENGINE overrides).
# The base is $PYTHON_IMAGE, by default the Dockerfile's digest-pinned python image. Where that
# cannot be pulled (no container registry reachable) a stand-in is made locally with mmdebstrap
# from Debian bookworm's python3 (3.11) and kept in the engine's storage, keyed by its recipe, so
# the next build reuses it. With podman the host's CA directory is mounted into the build steps
# only (a TLS-intercepting proxy's CA then works for pip; nothing of it lands in a layer).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)
# ARCH=arm64 builds for linux/arm64 (GH200/GB200 nodes); on an amd64 machine that needs QEMU's
# user-mode emulation registered with binfmt_misc (Debian: apt-get install qemu-user-static).
HOST_ARCH=$(uname -m | sed 's/x86_64/amd64/; s/aarch64/arm64/')
ARCH=${ARCH:-$HOST_ARCH}
if [[ $ARCH == "$HOST_ARCH" ]]; then IMAGE=${IMAGE:-vramguard:$VERSION}; else IMAGE=${IMAGE:-vramguard:$VERSION-$ARCH}; fi
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/vramguard/image
DEFAULT_BASE=$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)
STANDIN_PACKAGES=python3,python3-venv,python-is-python3,ca-certificates
STANDIN_SUITE=bookworm
# The tag names the recipe (suite, packages, and the mmdebstrap options below: bump STANDIN_RECIPE
# when changing them), so a changed recipe makes a new base and an unchanged one is reused.
STANDIN_RECIPE=2
STANDIN_TAG=localhost/vramguard-python-standin:$STANDIN_SUITE-$ARCH-$(printf '%s %s %s' "$STANDIN_RECIPE" "$STANDIN_SUITE" "$STANDIN_PACKAGES" | sha256sum | cut -c1-12)

log() { printf 'image: %s\n' "$*" >&2; }

engine() {
    if [[ -n ${CONTAINER_ENGINE:-} ]]; then
        echo "$CONTAINER_ENGINE"
    elif command -v docker > /dev/null && docker info > /dev/null 2>&1; then
        echo docker
    elif command -v podman > /dev/null; then
        echo podman
    else
        log "neither a Docker daemon nor podman found: install one (Debian: apt-get install podman runc netavark aardvark-dns iptables mmdebstrap)"
        exit 1
    fi
}

# Podman on hosts like the CI machines (hybrid cgroups, root without CAP_SYS_RESOURCE) needs runc,
# cgroupfs and ulimits it may set; keep that in a private containers.conf, not the machine's.
podman_conf() {
    [[ -n ${CONTAINERS_CONF:-} ]] && { echo "$CONTAINERS_CONF"; return; }
    command -v runc > /dev/null || return 0
    local nofile conf=$CACHE/containers.conf
    nofile=$(ulimit -Hn); [[ $nofile == unlimited || $nofile -gt 1048576 ]] && nofile=1048576
    mkdir -p "$CACHE"
    cat > "$conf.tmp" <<CONF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[network]
network_backend = "netavark"
CONF
    mv "$conf.tmp" "$conf"
    echo "$conf"
}

ENGINE=$(engine)
if [[ $ENGINE == podman ]]; then
    conf=$(podman_conf)
    [[ -n $conf ]] && export CONTAINERS_CONF=$conf
fi

have_image() { "$ENGINE" image inspect "$1" > /dev/null 2>&1; }

standin_base() {
    if have_image "$STANDIN_TAG"; then
        log "reusing the stand-in base $STANDIN_TAG"
    else
        command -v mmdebstrap > /dev/null || { log "mmdebstrap is needed to make a stand-in base (apt-get install mmdebstrap)"; exit 1; }
        [[ $(id -u) == 0 ]] || { log "making the stand-in base needs root (mmdebstrap --mode=root)"; exit 1; }
        log "no registry: making the stand-in base $STANDIN_TAG with mmdebstrap ($STANDIN_SUITE: $STANDIN_PACKAGES)"
        local tar
        tar=$(mktemp --suffix=.tar)
        # Without documentation, manual pages and translations, as the official slim images.
        mmdebstrap --quiet --variant=minbase --mode=root --architectures="$ARCH" --include="$STANDIN_PACKAGES" \
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            "$STANDIN_SUITE" "$tar" ${DEBIAN_MIRROR:-} >&2
        "$ENGINE" import --os linux --arch "$ARCH" \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "$tar" "$STANDIN_TAG" > /dev/null
        rm -f "$tar"
    fi
    echo "$STANDIN_TAG"
}

# The base to build on: $PYTHON_IMAGE if given, else the pinned default when it is present or
# can be pulled, else the local stand-in.
base_image() {
    if [[ -n ${PYTHON_IMAGE:-} ]]; then echo "$PYTHON_IMAGE"; return; fi
    if { [[ $ARCH == "$HOST_ARCH" ]] && have_image "$DEFAULT_BASE"; } \
        || timeout "${PULL_TIMEOUT:-60}" "$ENGINE" pull -q --platform "linux/$ARCH" "$DEFAULT_BASE" > /dev/null 2>&1; then
        echo "$DEFAULT_BASE"; return
    fi
    log "cannot pull $DEFAULT_BASE (no registry reachable?)"
    standin_base
}

cmd_build() {
    local base revision source started args=()
    started=$(date +%s)
    base=$(base_image)
    revision=$(git rev-parse HEAD 2> /dev/null || echo unknown)
    git diff --quiet HEAD 2> /dev/null || revision="$revision-dirty"
    source=${IMAGE_SOURCE:-$(git remote get-url origin 2> /dev/null || echo unknown)}
    args=(--build-arg "PYTHON_IMAGE=$base" --build-arg "VERSION=$VERSION" --build-arg "REVISION=$revision"
          --build-arg "SOURCE=$source" --platform "linux/$ARCH" -t "$IMAGE")
    if [[ $ENGINE == podman ]]; then
        args+=(--pull=never --layers)
        [[ -d /etc/ssl/certs ]] && args+=(--volume /etc/ssl/certs:/etc/ssl/certs:ro)
    fi
    log "building $IMAGE with $ENGINE on $base"
    "$ENGINE" build "${args[@]}" -f Dockerfile . >&2
    log "built $IMAGE in $(( $(date +%s) - started ))s: $("$ENGINE" image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
}

run_image() { "$ENGINE" run --rm --read-only --tmpfs /tmp --cap-drop ALL --user 65532:65532 --network none "$@"; }

locked_packages() {
    sed -n 's/^\([a-z0-9][^= ]*\)==\([^ ;\\]*\).*/\1==\2/p' requirements.lock
    echo "vramguard==$VERSION"
}

installed_packages() {
    run_image --entrypoint python "$IMAGE" -c '
import importlib.metadata, re
for dist in importlib.metadata.distributions():
    print(re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower() + "==" + dist.version)'
}

installed_matches_lock() { diff -u <(locked_packages | sort) <(installed_packages | sort); }

cmd_check() {
    have_image "$IMAGE" || { log "no image $IMAGE: run make image first"; exit 1; }
    local failed=0 out
    check() { local what=$1; shift; if out=$("$@" 2>&1); then log "ok: $what"; else log "FAILED: $what"; printf '%s\n' "$out" >&2; failed=1; fi; }
    check "runs as 65532:65532 by default" bash -c "[[ \$($ENGINE image inspect --format '{{.Config.User}}' $IMAGE) == 65532:65532 ]] && [[ \$($ENGINE run --rm --entrypoint python $IMAGE -c 'import os; print(os.getuid(), os.getgid())') == '65532 65532' ]]"
    check "entrypoint --help on a read-only root" run_image "$IMAGE" --help
    local sub
    for sub in extender webhook agent explain plan audit certs keep-certs webhook-config scheduler-config; do
        check "vramguard $sub --help" run_image "$IMAGE" "$sub" --help
    done
    check "kubectl-vram --help" run_image --entrypoint kubectl-vram "$IMAGE" --help
    check "OCI labels (version, revision, source)" bash -c "$ENGINE image inspect --format '{{index .Config.Labels \"org.opencontainers.image.version\"}} {{index .Config.Labels \"org.opencontainers.image.revision\"}} {{index .Config.Labels \"org.opencontainers.image.source\"}}' $IMAGE | grep -Eq '^$VERSION [0-9a-f]{7,}'"
    check "LICENSE shipped" run_image --entrypoint test "$IMAGE" -s /usr/share/doc/vramguard/LICENSE
    check "no compiler, pip, setuptools or ensurepip wheels" run_image --entrypoint python "$IMAGE" -c '
import importlib.util, shutil, sys, glob
found = [c for c in ("gcc", "cc", "c++", "g++", "clang", "pip", "pip3") if shutil.which(c)]
found += [m for m in ("pip", "setuptools", "pkg_resources", "ensurepip") if importlib.util.find_spec(m)]
found += glob.glob("/usr/share/python-wheels/*")
sys.exit(f"left in the image: {found}" if found else 0)'
    # So that the SBOM made from the lock (scripts/lock.sh sbom) lists what the image holds.
    check "installed packages are exactly requirements.lock's and vramguard" installed_matches_lock
    check "bytecode is hash-based" run_image --entrypoint python "$IMAGE" -c '
import glob, sys
pycs = glob.glob("/opt/vramguard/lib/python3*/site-packages/**/*.pyc", recursive=True)
stamped = [p for p in pycs if int.from_bytes(open(p, "rb").read(8)[4:8], "little") == 0]
sys.exit(f"{len(stamped)} of {len(pycs)} .pyc files are timestamp-based, e.g. {stamped[:3]}" if stamped or not pycs else 0)'
    if [[ $failed != 0 ]]; then log "image checks failed"; exit 1; fi
    local managers
    managers=$(run_image --entrypoint sh "$IMAGE" -c 'for c in dpkg apt-get apt; do command -v $c; done' | tr '\n' ' ' || true)
    [[ -n $managers ]] && log "note: the Debian base keeps its own package tools ($managers), usable by root only; the service runs as 65532"
    cmd_size
}

# What takes the space: the base, the virtualenv, its largest packages.
cmd_size() {
    log "size of $IMAGE: $("$ENGINE" image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
    run_image --entrypoint sh "$IMAGE" -c 'du -sm / --exclude=/proc --exclude=/sys 2>/dev/null | sed "s|/$|total (MB)|"; du -sm /opt/vramguard /usr/lib/python3* /usr/local/lib/python3* 2>/dev/null; du -sm /opt/vramguard/lib/python3*/site-packages/* 2>/dev/null | sort -rn | head -n 8' >&2
}

cmd_env() {
    echo "VRAMGUARD_IMAGE=$IMAGE"
    echo "VRAMGUARD_CONTAINER_ENGINE=$ENGINE"
    [[ -n ${CONTAINERS_CONF:-} ]] && echo "CONTAINERS_CONF=$CONTAINERS_CONF"
    return 0
}

case ${1:-} in
    build) cmd_build ;;
    check) cmd_check ;;
    size) cmd_size ;;
    env) cmd_env ;;
    base) base_image ;;
    *) echo "usage: $0 build|check|size|env|base" >&2; exit 2 ;;
esac
