# Sourced by scripts/launch_pretrain.sh and recipes/*.sh (needs ROOT, the checkout): what they share.
#
# find_python sets PYTHON, the interpreter that runs the trainer, by one rule:
#   1. $PYTHON, if set;
#   2. else the checkout's virtualenv, $VENV/bin/python (VENV defaults to $ROOT/.venv, the one that
#      scripts/setup_env.sh makes), if it exists;
#   3. else python3 from PATH: the interpreter of the environment you launch from (an activated
#      virtualenv or conda environment).
# The one chosen must have torch, or find_python stops with exit status 2 saying which interpreter it
# tried and how to choose another; it never falls back to a different interpreter on its own.
find_python() {
  local venv="${VENV:-$ROOT/.venv}"
  if [ -n "${PYTHON:-}" ]; then
    PYTHON_FROM="\$PYTHON"
  elif [ -x "$venv/bin/python" ]; then
    PYTHON="$venv/bin/python"; PYTHON_FROM="the checkout's virtualenv"
  else
    PYTHON="python3"; PYTHON_FROM="python3 on PATH"
  fi
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "[launch] error: no interpreter '$PYTHON' ($PYTHON_FROM); set PYTHON=/path/to/python, or run" \
         "'bash scripts/setup_env.sh' to make $venv" >&2
    exit 2
  fi
  if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' 2>/dev/null; then
    echo "[launch] error: $PYTHON ($PYTHON_FROM) has no torch; set PYTHON=/path/to/python of an environment" \
         "with this project installed, activate that environment, or run 'bash scripts/setup_env.sh' to make $venv" >&2
    exit 2
  fi
  export PYTHON
}

# print_header FILE: the comment block at the top of FILE (after the shebang), without the '# '.
print_header() {
  sed -n '2,/^[^#]/{/^#/!d;s/^# \{0,1\}//;p}' "$1"
}

# has_flag FLAG ARGS...: whether FLAG is among ARGS (before a '--').
has_flag() {
  local flag="$1" a; shift
  for a in "$@"; do
    [ "$a" = "--" ] && return 1
    [ "$a" = "$flag" ] && return 0
  done
  return 1
}
