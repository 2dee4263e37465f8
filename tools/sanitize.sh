#!/usr/bin/env bash
# Builds ascend_dualpath._C with AddressSanitizer + UndefinedBehaviorSanitizer (ADP_SANITIZE=1, gcc) in a copy of
# the working tree under build/sanitize/ (the normal in-place _C is never touched), then runs the emulator and
# transport tests against that build. Exits non-zero when the tests fail or any sanitizer wrote a report.
#
# Python itself is not instrumented, so libasan (and libstdc++) are preloaded; leak detection is off (the interpreter and torch
# keep allocations alive until exit by design). Reports go to files, so a report from a child process a test
# spawned is not lost with that child's stderr.
#
# Usage: tools/sanitize.sh [pytest arguments...]   (default: -q tests/emulator tests/transport)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$root/build/sanitize
tree=$work/tree
reports=$work/reports
start=$(date +%s)

# Copy tracked and untracked-but-not-ignored files; files whose content is unchanged keep their mtime, so the
# ninja build in the copy recompiles only what changed since the last run.
mkdir -p "$tree"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' path; do
    [ -f "$path" ] || continue
    if ! cmp -s "$path" "$tree/$path"; then
        mkdir -p "$tree/$(dirname "$path")"
        cp -p "$path" "$tree/$path"
    fi
done

echo "sanitize: building _C with ASan + UBSan in $tree"
(cd "$tree" && ADP_SANITIZE=1 ADP_WITH_NPU=0 python3 setup.py build_ext --inplace >"$work/build.log" 2>&1) || {
    tail -40 "$work/build.log"
    echo "sanitize: build failed (log: $work/build.log)"
    exit 1
}
built=$(date +%s)
echo "sanitize: built in $((built - start)) s"

libasan=$(gcc -print-file-name=libasan.so)
[ -f "$libasan" ] || { echo "sanitize: libasan.so not found (install gcc's libasan)"; exit 1; }
# libstdc++ preloaded too: python does not link it, and ASan must find the real __cxa_throw when it starts
libstdcxx=$(gcc -print-file-name=libstdc++.so)
rm -rf "$reports"
mkdir -p "$reports"

[ "$#" -gt 0 ] || set -- -q tests/emulator tests/transport
set +e
(cd "$tree" && env LD_PRELOAD="$libasan $libstdcxx" \
    ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:disable_coredump=1:log_path=$reports/asan" \
    UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$reports/ubsan" \
    python3 -m pytest -p no:cacheprovider "$@")
rc=$?
set -e
echo "sanitize: tests ran in $(($(date +%s) - built)) s (pytest exit $rc)"

if compgen -G "$reports/*" >/dev/null; then
    for report in "$reports"/*; do
        echo "==== $report"
        head -60 "$report"
    done
    echo "sanitize: sanitizer reports found (above)"
    exit 1
fi
# pytest exits 5 when nothing was collected: not a failure of the code under test
[ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || exit "$rc"
echo "sanitize: no sanitizer report"
