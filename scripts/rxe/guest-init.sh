# shellcheck shell=sh
# PID 1 of the rxe guest (stage 2), run by busybox sh from the host's tree
# after initrd-init.sh set everything up: add rxe0, run the command that
# scripts/rxe/run wrote to cmd.sh, write its exit code to rc, power off.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
B=/run/rxe/bin/busybox out=/run/rxe/out
if rdma link add "$RXE_DEV" type rxe netdev "$RXE_NETDEV"; then
  cd / && bash $out/cmd.sh < /dev/null
  rc=$?
else
  echo "rxe guest: rdma link add failed" >&2
  rc=125
fi
# stty waits (TCSADRAIN) for the console to drain: without it, poweroff cuts
# off the end of the output.
$B stty -F /dev/console -onlcr
echo $rc > $out/rc
echo 0 > /proc/sys/kernel/printk
$B poweroff -f
