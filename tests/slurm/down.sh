#!/usr/bin/env bash
# Stop what tests/slurm/up.sh started in DIR, by the pid files it left (never by process name).
# Daemons delete their pid files when they exit cleanly, so all are read before any is signalled;
# PID 1 here reaps late, so "gone" means no such process or a zombie.
D=${1:?usage: down.sh DIR}
pids=""
for f in "$D"/slurmd-*.pid "$D"/slurmctld.pid "$D"/munge/munged.pid; do
  [ -f "$f" ] && pids="$pids $(cat "$f")"
done
[ -z "$pids" ] && exit 0
kill $pids 2>/dev/null
alive() { for p in $pids; do [ -d /proc/$p ] && [ "$(awk '{print $3}' /proc/$p/stat 2>/dev/null)" != Z ] && echo "$p"; done; }
for i in $(seq 50); do [ -z "$(alive)" ] && exit 0; sleep 0.1; done
left=$(alive); [ -n "$left" ] && kill -9 $left 2>/dev/null
exit 0
