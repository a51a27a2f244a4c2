#!/bin/sh
# A wrapper script as a scheduler's job runs it, for tests/test_command_forms.py:
#   command_forms.sh exec|child CASE
# exec: it execs Python (the rank keeps this pid); child: it runs Python through
# elastic_hvd.runner.program as a child and exits with its status (two records of one rank).
mode=$1
shift
worker="$(dirname "$0")/command_forms.py"
if [ "$mode" = exec ]; then
    exec "$TEST_PYTHON" "$worker" "$@"
fi
"$TEST_PYTHON" -m elastic_hvd.runner.program "$worker" "$@"
exit $?
