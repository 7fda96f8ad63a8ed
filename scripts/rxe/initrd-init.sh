#!/bin/busybox sh
# shellcheck shell=sh
# /init of the rxe guest's initramfs (stage 1), run by static busybox: every
# exec of a dynamically linked binary over 9p costs 0.15-0.3 s under TCG, so
# all setup happens here. Loads the modules, mounts the host's / (9p,
# read-only) under a tmpfs overlay, brings up the netdev for rxe, then
# switch_root to guest-init.sh as PID 1.
# The host's scripts/rxe/run passes rxeinit, rxekdir, rxenet, rxeip and rxedebug on
# the kernel command line; the kernel hands them to /init as environment.
# shellcheck disable=SC2154,SC2086,SC2015  # set by the kernel; no spaces anywhere
B=/bin/busybox
die() { echo "rxe guest: $*"; $B poweroff -f; }
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
[ "$rxedebug" = 1 ] || echo 1 > /proc/sys/kernel/printk
for m in $($B cat /modules.list); do $B insmod /mod/$m.ko || die "insmod $m failed"; done

$B mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 root /lower || die "9p root"
$B mount -t tmpfs -o mode=755 rw /rw
$B mkdir /rw/upper /rw/work
$B mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot || die overlay
N=/newroot
for d in proc sys dev; do $B mount --move /$d $N/$d; done   # /proc is now $N/proc
$B mount -t tmpfs -o mode=755 run $N/run
$B mkdir -p $N/run/rxe/out $N/run/rxe/bin $N/dev/pts $N/dev/shm
$B mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=none rxeout $N/run/rxe/out || die "9p out"
$B mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts $N/dev/pts
$B mount -t tmpfs -o mode=1777 shm $N/dev/shm
# The cached kernel's modules at the usual place, so that modprobe and the
# kernel's request_module work in the guest (the host has none for this kernel).
K=$N/lib/modules/$($B uname -r)
$B mkdir -p $K
$B mount --bind $N$rxekdir/lib/modules/${K##*/} $K
echo rxe-guest > $N/proc/sys/kernel/hostname
$B stty -F /dev/console -onlcr   # no CR added to every LF

$B ip link set lo up
case $rxenet in
  virtio) dev=eth0 ip=10.0.2.15 ;;
  wire) dev=eth0 ip=$rxeip ;;   # scripts/rxe/pair: the other guest is at the other end
  *) dev=dummy0 ip=192.0.2.1 ;;
esac
$B ip addr add $ip/24 dev $dev && $B ip link set $dev up || die "no netdev $dev"
export RXE_DEV=rxe0 RXE_NETDEV=$dev RXE_IP=$ip
# Stage 2's shell is this busybox, copied to tmpfs: no slow exec over 9p.
$B cp $B $N/run/rxe/bin/
exec $B switch_root $N /run/rxe/bin/busybox sh "$rxeinit"
