#!/bin/sh
# Run `svc serve` on a zero-CPU Ray node that joins an existing Ray cluster.
#
# Why: the gateway streams tokens back from actor hosts through Ray streaming generators
# (ARCHITECTURE.md, decision 5), and Ray Client (ray://...) rejects them ("Streaming actor
# methods (num_returns="streaming") are not currently supported when using Ray Client",
# ray/util/client/worker.py in Ray 2.60). A Ray driver without Ray Client must run on a Ray
# node, so this script starts a raylet that joins the head (no CPUs, so no actor host is ever
# placed beside the gateway), then runs svc with SVC_RAY_ADDRESS=auto.
#
# Environment: SVC_RAY_HEAD (host:port of the head's GCS, e.g. ray-head:6379), required.
# Arguments are passed to `svc serve`. SIGTERM/SIGINT are forwarded to svc (graceful
# shutdown, SVC_SHUTDOWN_GRACE_SEC); the local raylet is stopped after svc exits.
set -eu

: "${SVC_RAY_HEAD:?set SVC_RAY_HEAD to the Ray head GCS address, host:port}"

ray start --address="$SVC_RAY_HEAD" --num-cpus=0 --disable-usage-stats
export SVC_ACTOR_RUNTIME="${SVC_ACTOR_RUNTIME:-ray}"
export SVC_RAY_ADDRESS=auto

svc serve "$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT
set +e
wait "$child"
status=$?
if kill -0 "$child" 2>/dev/null; then
  # wait was interrupted by the trapped signal: wait for svc to finish its graceful shutdown.
  wait "$child"
  status=$?
fi
ray stop --grace-period 10 >/dev/null 2>&1
exit "$status"
