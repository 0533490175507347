#!/bin/bash
# gpuinfra-spot-notice: the instance's own spot notice starts the kubelet's graceful node shutdown,
# so every pod's preStop runs even when the Kubernetes API server cannot be reached (Karpenter's
# drain needs it). Runs on the node (systemd unit gpuinfra-spot-notice.service, installed by the
# EC2NodeClass user data: components/aws/nodeadm.py), where IMDS is one hop away.
#
# - EC2: the interruption notice appears at meta-data/spot/instance-action two minutes before the
#   instance is stopped or terminated; AWS recommends checking every 5 seconds (EC2 User Guide,
#   "Spot Instance interruption notices"). IMDSv2: PUT latest/api/token with
#   X-aws-ec2-metadata-token-ttl-seconds, then GETs with X-aws-ec2-metadata-token; 404 while there is
#   no notice, 401 once the token expired.
# - logind: PowerOff() honours delay inhibitor locks; it emits PrepareForShutdown(true) and waits
#   for them up to InhibitDelayMaxSec (org.freedesktop.login1(5)). The kubelet holds such a lock
#   when shutdownGracePeriod is set, raises InhibitDelayMaxSec to it, and kills the pods (preStop,
#   then SIGTERM) within it, regular pods first (kubernetes.io "Node Shutdowns";
#   pkg/kubelet/nodeshutdown/nodeshutdown_manager_linux.go).
set -u
IMDS="${GPUINFRA_IMDS:-http://169.254.169.254}"
POLL_S="${GPUINFRA_POLL_S:-5}"
TOKEN_TTL_S=21600
token=""
while :; do
  if [ -z "$token" ]; then
    token=$(curl -sf -m 2 -X PUT "$IMDS/latest/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: $TOKEN_TTL_S") || token=""
  fi
  code=$(curl -s -m 2 -o /dev/null -w '%{http_code}' -H "X-aws-ec2-metadata-token: $token" \
    "$IMDS/latest/meta-data/spot/instance-action")
  case "$code" in
    200)
      echo "gpuinfra-spot-notice: spot interruption notice; shutting down so the kubelet drains every pod"
      if [ -n "${GPUINFRA_POWEROFF:-}" ]; then
        $GPUINFRA_POWEROFF
      else
        busctl call org.freedesktop.login1 /org/freedesktop/login1 org.freedesktop.login1.Manager PowerOff b false
      fi
      exit $?
      ;;
    401)
      token=""  # expired: a new one on the next poll, a second from now
      sleep 1
      continue
      ;;
  esac
  sleep "$POLL_S"
done
