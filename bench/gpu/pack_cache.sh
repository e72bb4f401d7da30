#!/usr/bin/env bash
# bench/gpu/pack_cache.sh DIR: the numba cache of this call (CPU and CUDA kernels compiled under
# /tmp/strata-cache) as DIR/numba-cache.tar.xz, to carry to the next call in .gpu/ (setup.sh restores it there).
# Entries whose source changed are recompiled there (setup.sh gives each source file a content-derived mtime).
set -uo pipefail
dest=${1:?usage: pack_cache.sh DIR}
[ -d /tmp/strata-cache ] || { echo "pack_cache.sh: no /tmp/strata-cache" >&2; exit 1; }
mkdir -p "$dest"
# one block with a dictionary over the whole tar: the cache holds near-copies of each kernel per numba
# environment, which a small dictionary cannot see (6.8 MB at xz -6 against 3.3 MB)
tar -C /tmp/strata-cache -cf - . | xz -T1 --lzma2=preset=9,dict=192MiB >"$dest/numba-cache.tar.xz"
size=$(stat -c %s "$dest/numba-cache.tar.xz")
printf '[%s] numba cache: %s of files in %s packed to %s bytes\n' "$(date +%H:%M:%S)" \
    "$(du -sh /tmp/strata-cache | cut -f1)" "$(find /tmp/strata-cache -type f | wc -l)" "$size"
if [ "$size" -ge $((16 * 1024 * 1024)) ]; then
    echo "pack_cache.sh: over 16 MiB, it would not come back; removed" >&2
    rm -f "$dest/numba-cache.tar.xz"
    exit 1
fi
