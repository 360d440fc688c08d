#!/usr/bin/env bash
# Run transformers' own common model tests (ModelTesterMixin, ConfigTester, CausalLMModelTest) against
# boost-hf's classes, once per bottleneck, in a scratch folder outside the repository. See
# tests/hf_common_tests.md for what this runs and the last recorded result.
#
# Usage: tests/hf_common/run_hf_common_tests.sh [SCRATCH_DIR] [extra pytest args...]
#   SCRATCH_DIR     default /tmp/hf_common_scratch (recreated each run, except the downloaded sdist)
#   HF_TESTS_EXTRA  a folder laid out like transformers' tests/ holding files the sdist lacks
#                   (causal_lm_tester.py, utils/test_configuration_utils.py, ...), used when GitHub is
#                   not reachable to fetch them at the installed version's tag
#   PYTHON          the interpreter with boost-hf and transformers installed (default: python)
#
# Nothing of transformers' is copied into the repository: the sdist and fetched files stay in SCRATCH_DIR.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SCRATCH=${1:-/tmp/hf_common_scratch}
shift || true
PY=${PYTHON:-python}
VERSION=$("$PY" -c "import transformers; print(transformers.__version__)")
SITE=$("$PY" -c "import os, transformers; print(os.path.dirname(transformers.__file__))")

mkdir -p "$SCRATCH"
SDIST="$SCRATCH/transformers-$VERSION.tar.gz"
[ -f "$SDIST" ] || "$PY" -m pip download --no-deps --no-binary :all: "transformers==$VERSION" -d "$SCRATCH"
rm -rf "$SCRATCH/tests" "$SCRATCH/src" "$SCRATCH/transformers-$VERSION"
tar -xzf "$SDIST" -C "$SCRATCH"
mv "$SCRATCH/transformers-$VERSION/tests" "$SCRATCH/tests"
rm -rf "$SCRATCH/transformers-$VERSION"
T="$SCRATCH/tests"

# test_pipeline_mixin.py imports transformers from <root>/src/transformers: point it at the installed copy.
mkdir -p "$SCRATCH/src"
ln -sfn "$SITE" "$SCRATCH/src/transformers"

# Files the common tests import that the sdist does not ship: fetched at the version's tag, else taken
# from HF_TESTS_EXTRA, else (for the three that only gate other suites) an empty stand-in of our own.
fetch() {  # fetch <path under tests/>
    local path=$1
    mkdir -p "$(dirname "$T/$path")"
    [ -f "$T/$path" ] && return 0
    if curl -fsSL --max-time 20 -o "$T/$path" \
        "https://raw.githubusercontent.com/huggingface/transformers/v$VERSION/tests/$path" 2>/dev/null; then
        echo "fetched tests/$path (v$VERSION)"
    elif [ -n "${HF_TESTS_EXTRA:-}" ] && [ -f "$HF_TESTS_EXTRA/$path" ]; then
        cp "$HF_TESTS_EXTRA/$path" "$T/$path"
        echo "tests/$path from $HF_TESTS_EXTRA"
    else
        rm -f "$T/$path"
        return 1
    fi
}
for path in causal_lm_tester.py utils/test_configuration_utils.py; do
    fetch "$path" || { echo "missing tests/$path: give HF_TESTS_EXTRA (see tests/hf_common_tests.md)" >&2; exit 2; }
done
fetch generation/test_utils.py || {
    echo "WARNING: tests/generation/test_utils.py unavailable: GenerationTesterMixin is empty (no generate tests)" >&2
    printf 'class GenerationTesterMixin:\n    input_name = "input_ids"\n    model_tester = None\n    all_generative_model_classes = ()\n    max_new_tokens = 3\n' > "$T/generation/test_utils.py"
}
fetch exporters/test_export.py || {
    echo "WARNING: tests/exporters/test_export.py unavailable: ExportTesterMixin is empty (no export tests)" >&2
    printf 'class ExportTesterMixin:\n    pass\n' > "$T/exporters/test_export.py"
}
fetch utils/tiny_model_summary.json || echo '{}' > "$T/utils/tiny_model_summary.json"
for dir in "$T" "$T/utils" "$T/generation" "$T/exporters" "$T/models" "$T/models/boost_llama"; do
    mkdir -p "$dir"
    touch "$dir/__init__.py"
done

cp "$HERE/boost_llama_common.py" "$T/models/boost_llama/test_modeling_boost_llama.py"

# The common tests need `parameterized`; install it into the scratch folder if the venv lacks it.
EXTRA_PATH=""
if ! "$PY" -c "import parameterized" 2>/dev/null; then
    "$PY" -m pip install -q --target "$SCRATCH/site" parameterized
    EXTRA_PATH=":$SCRATCH/site"
fi

cd "$SCRATCH"
PYTHONPATH="$REPO$EXTRA_PATH" "$PY" -m pytest -p no:cacheprovider -q -W ignore -rfE \
    --junitxml="$SCRATCH/hf_common.xml" tests/models/boost_llama/test_modeling_boost_llama.py "$@" || rc=$?

# Counts per bottleneck (pytest's own subtests are reported by pytest above, not counted here).
"$PY" - "$SCRATCH/hf_common.xml" <<'EOF'
import collections, sys, xml.etree.ElementTree as ET
counts = collections.defaultdict(collections.Counter)
for case in ET.parse(sys.argv[1]).iter("testcase"):
    outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
        "skipped" if case.find("skipped") is not None else "passed")
    counts[case.get("classname").rsplit(".", 1)[-1]][outcome] += 1
for cls, c in counts.items():
    print(f"{cls:28s} {c['passed']:4d} passed {c['failed']:4d} failed {c['skipped']:4d} skipped of {sum(c.values())}")
EOF
exit ${rc:-0}
