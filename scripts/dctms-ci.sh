#!/usr/bin/env bash
# dctms-ci.sh: the plan review a pull request gets, for any CI system (the GitHub Action runs it).
#
# In the repository's work tree (any folder inside it), for the tracked plan files matching
# DCTMS_PLANS:
#   1. `dctms check` each plan: it must re-compile to the checked-in bytes (else: stale or edited);
#   2. `dctms diff` each plan against its copy at the merge base of DCTMS_BASE and HEAD, failing
#      when M_max grew by more than DCTMS_FAIL_ABOVE or exceeds DCTMS_BUDGET (a plan new on this
#      branch is held to the budget only);
#   3. write the markdown report to DCTMS_REPORT, append it to $GITHUB_STEP_SUMMARY when that is
#      set, and write status=N and report=PATH to $GITHUB_OUTPUT when that is set.
#
# Settings (environment variables; all optional):
#   DCTMS_PLANS       git glob of the plan files                      default: **/*.plan
#   DCTMS_BASE        revision to compare with (e.g. origin/main)     default: origin/$GITHUB_BASE_REF,
#                                                                     else the first parent, HEAD^
#   DCTMS_BUDGET      fail when a plan's M_max exceeds this size (16GiB)
#   DCTMS_FAIL_ABOVE  fail when M_max grew by more than this (2% or 64MiB); several: space-separated
#   DCTMS_MODEL       model folder to check the plans against         default: each plan's recorded config
#   DCTMS_CONFIG      config.json to check the plans against (instead of DCTMS_MODEL)
#   DCTMS_CHECK       "false" skips step 1                            default: true
#   DCTMS_REPORT      where the markdown goes                         default: dctms-report.md
#   DCTMS             the dctms command                               default: dctms
#
# Exit status: 0 all plans up to date and within the limits; 1 a plan is stale or edited, or a limit
# is crossed; 2 bad input (no plan matches, a plan or the base cannot be read, a bad limit).
set -uo pipefail

plans_glob=${DCTMS_PLANS:-**/*.plan}
report=${DCTMS_REPORT:-dctms-report.md}
read -r -a dctms <<< "${DCTMS:-dctms}"
read -r -a fail_above <<< "${DCTMS_FAIL_ABOVE:-}"
budget=${DCTMS_BUDGET:-}
status=0
stale=0   # plans dctms check found stale or edited
crossed=0 # plans whose M_max crossed a limit

note() { echo "dctms-ci: $*" >&2; }
worse() { if [ "$1" -gt "$status" ]; then status=$1; fi; }

case "$report" in /*) ;; *) report="$PWD/$report" ;; esac
if ! top=$(git rev-parse --show-toplevel 2>/dev/null); then
  note "not inside a git work tree"
  exit 2
fi
cd "$top" || exit 2

if [ -n "${DCTMS_BASE:-}" ]; then
  base_name=$DCTMS_BASE
elif [ -n "${GITHUB_BASE_REF:-}" ]; then
  base_name=origin/$GITHUB_BASE_REF
else
  base_name=HEAD^
fi
if ! git rev-parse --verify --quiet "$base_name^{commit}" > /dev/null; then
  note "base revision $base_name does not exist (fetch it: git fetch origin <branch>, or check out with fetch-depth: 0)"
  exit 2
fi
# Compare with the merge base, as the pull request's own diff does: commits that landed on the base
# branch meanwhile are not this branch's doing. A shallow clone may lack it: then the base itself.
base=$(git merge-base "$base_name" HEAD 2> /dev/null || git rev-parse "$base_name^{commit}")
base_short=$(git rev-parse --short "$base")

mapfile -d '' plans < <(git ls-files -z -- ":(glob)$plans_glob")
if [ "${#plans[@]}" -eq 0 ]; then
  note "no tracked file matches DCTMS_PLANS=$plans_glob"
  exit 2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The base's plans, matched by git itself (ls-tree knows no glob pathspecs): a throwaway index.
GIT_INDEX_FILE="$work/base.index" git read-tree "$base"
mapfile -d '' base_plans < <(GIT_INDEX_FILE="$work/base.index" git ls-files -z -- ":(glob)$plans_glob")
body=$work/body.md
: > "$body"

# ------------------------------------------------------------------------------ 1. drift check
if [ "${DCTMS_CHECK:-true}" != "false" ]; then
  check_args=()
  if [ -n "${DCTMS_MODEL:-}" ]; then check_args+=(--model "$DCTMS_MODEL"); fi
  if [ -n "${DCTMS_CONFIG:-}" ]; then check_args+=(--config "$DCTMS_CONFIG"); fi
  "${dctms[@]}" check "${check_args[@]}" "${plans[@]}" > "$work/check.out" 2> "$work/check.err"
  rc=$?
  worse "$rc"
  {
    if [ "$rc" -eq 0 ]; then
      echo "### ✅ dctms check: all ${#plans[@]} plans re-compile to the checked-in bytes"
    elif [ "$rc" -eq 1 ]; then
      stale=$(grep -c -E ': (stale|edited): ' "$work/check.err")
      echo "### ❌ dctms check: $stale of ${#plans[@]} plans are stale or edited"
      echo
      echo "Re-make each with the command at the end of its line and commit the result."
    else
      echo "### ❌ dctms check could not check every plan (exit $rc)"
    fi
    echo
    echo '```'
    cat "$work/check.out" "$work/check.err"
    echo '```'
    echo
  } >> "$body"
  cat "$work/check.err" >&2
fi

# ------------------------------------------------------------------------ 2. diff against base
limits=()
for limit in "${fail_above[@]}"; do limits+=(--fail-above "$limit"); done
if [ -n "$budget" ]; then limits+=(--budget "$budget"); fi

in_base() {
  local p
  for p in "${base_plans[@]}"; do [ "$p" = "$1" ] && return 0; done
  return 1
}

n=0
for plan in "${plans[@]}"; do
  n=$((n + 1))
  old="$work/base-$n.plan"
  if in_base "$plan" && git show "$base:$plan" > "$old" 2> /dev/null; then
    "${dctms[@]}" diff --format markdown "${limits[@]}" \
      --old-label "$base_name:$plan" --new-label "$plan" "$old" "$plan" \
      >> "$body" 2> "$work/diff.err"
    rc=$?
  else
    # New on this branch: nothing to compare with; the budget still applies.
    {
      echo "### dctms plan: \`$plan\` is new (not on $base_name)"
      echo
      echo '```'
      "${dctms[@]}" show "$plan" 2>&1
      echo '```'
    } >> "$body"
    rc=0
    if [ -n "$budget" ]; then
      "${dctms[@]}" diff --format json --budget "$budget" "$plan" "$plan" > /dev/null 2> "$work/diff.err"
      rc=$?
      if [ "$rc" -eq 1 ]; then
        echo >> "$body"
        echo "❌ **FAIL: $(sed -e 's/^dctms diff: //' "$work/diff.err" | head -n 1)**" >> "$body"
      fi
    else
      : > "$work/diff.err"
    fi
  fi
  if [ "$rc" -eq 1 ]; then crossed=$((crossed + 1)); fi
  if [ "$rc" -eq 2 ]; then
    { echo; echo "**dctms could not read \`$plan\` or its base copy:** $(head -n 1 "$work/diff.err")"; } >> "$body"
  fi
  cat "$work/diff.err" >&2
  echo >> "$body"
  worse "$rc"
done

for plan in "${base_plans[@]}"; do
  case " ${plans[*]} " in *" $plan "*) continue ;; esac
  printf '### dctms plan: `%s` was removed (it is on %s)\n\n' "$plan" "$base_name" >> "$body"
done

# ----------------------------------------------------------------------------------- 3. report
case "$status" in
  0) verdict="✅ dctms: ${#plans[@]} plans up to date and within the limits" ;;
  1)
    verdict="❌ dctms:"
    if [ "$stale" -gt 0 ]; then verdict+=" $stale of ${#plans[@]} plans stale or edited"; fi
    if [ "$stale" -gt 0 ] && [ "$crossed" -gt 0 ]; then verdict+=";"; fi
    if [ "$crossed" -gt 0 ]; then verdict+=" M_max over a limit in $crossed of ${#plans[@]} plans"; fi
    ;;
  *) verdict="❌ dctms: a plan could not be read (exit $status)" ;;
esac
{
  echo "## $verdict"
  echo
  echo "Plans \`$plans_glob\` at \`$(git rev-parse --short HEAD)\` against \`$base_name\` (merge base \`$base_short\`)${budget:+; budget $budget}${DCTMS_FAIL_ABOVE:+; allowed growth $DCTMS_FAIL_ABOVE}."
  echo
  cat "$body"
} > "$report"

if [ -n "${GITHUB_STEP_SUMMARY:-}" ]; then cat "$report" >> "$GITHUB_STEP_SUMMARY"; fi
if [ -n "${GITHUB_OUTPUT:-}" ]; then
  echo "status=$status" >> "$GITHUB_OUTPUT"
  echo "report=$report" >> "$GITHUB_OUTPUT"
fi
note "$verdict; report in $report"
exit "$status"
