#!/bin/sh
# A wrapper script as a scheduler's job runs it, for tests/test_command_forms.py:
#   command_forms.sh exec|child SCRIPT [ARGS]
# exec: it execs Python on SCRIPT (the rank keeps this pid); child: it runs SCRIPT through
# elastic_hvd.runner.program as a child and exits with its status (two records of one rank).
mode=$1
shift
if [ "$mode" = exec ]; then
    exec "$TEST_PYTHON" "$@"
fi
"$TEST_PYTHON" -m elastic_hvd.runner.program "$@"
exit $?
