#!/usr/bin/env bash
# The last-gasp page's msrun-resume.sh: msrun.sh with --is_recover=1, resuming from the newest last-gasp checkpoint
# in ./ttp_checkpoints.
#
#   bash examples/last_gasp/msrun-resume.sh [options of mindio_ttp_case.py]
exec bash "$(dirname "${BASH_SOURCE[0]}")/msrun.sh" --is_recover=1 "$@"
