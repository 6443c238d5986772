/*
 * The default seccomp filter of every sandboxed process (included by orchard_enter.c).
 *
 * Modelled on the container default profiles (Docker/containerd, Podman): deny the
 * system calls a workload in an unprivileged sandbox never needs and that widen the
 * kernel's attack surface (kernel keyrings, module loading, BPF, perf, mounting,
 * namespaces, io_uring, handle-based opens, clock and swap changes, ...). Denied calls
 * fail with EPERM; calls of another ABI (i386 on x86_64, x32) kill the process, so the
 * numbers below cannot be bypassed. Installed after no_new_privs, just before the
 * command runs, so it binds everything the command starts.
 *
 * Socket families: AF_VSOCK is refused (as in the container default profiles): a network
 * namespace does not confine it, so it would reach the hypervisor's or host's vsock
 * services from a sandbox without network. The others are the kernel's to refuse:
 * AF_PACKET and raw sockets need CAP_NET_RAW, netlink changes need CAP_NET_ADMIN, and a
 * sandbox has no capability; AF_UNIX, AF_INET and AF_INET6 stay inside its namespaces.
 */
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>

#if defined(__x86_64__)
#define SECCOMP_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define SECCOMP_ARCH AUDIT_ARCH_AARCH64
#else
#error "orchard-enter: no seccomp architecture for this target"
#endif

static const int denied_syscalls[] = {
    __NR_acct, __NR_add_key, __NR_bpf, __NR_clock_adjtime, __NR_clock_settime, __NR_delete_module,
    __NR_finit_module, __NR_fsconfig, __NR_fsmount, __NR_fsopen, __NR_fspick, __NR_init_module,
    __NR_io_uring_enter, __NR_io_uring_register, __NR_io_uring_setup, __NR_kexec_file_load, __NR_kexec_load,
    __NR_keyctl, __NR_lookup_dcookie, __NR_mount, __NR_move_mount, __NR_name_to_handle_at, __NR_open_by_handle_at,
    __NR_open_tree, __NR_perf_event_open, __NR_pivot_root, __NR_quotactl, __NR_reboot, __NR_request_key,
    __NR_setns, __NR_settimeofday, __NR_swapoff, __NR_swapon, __NR_umount2, __NR_unshare, __NR_userfaultfd,
    __NR_adjtimex, __NR_syslog, __NR_kcmp, __NR_mount_setattr, __NR_quotactl_fd, __NR_pidfd_getfd,
#if defined(__x86_64__)
    __NR_create_module, __NR_get_kernel_syms, __NR_ioperm, __NR_iopl, __NR_nfsservctl, __NR_query_module,
    __NR_sysfs, __NR__sysctl, __NR_uselib, __NR_ustat, __NR_vhangup,
#endif
};

#define N_DENIED (sizeof denied_syscalls / sizeof denied_syscalls[0])
#ifndef __NR_setxattrat
#define __NR_setxattrat 463 /* Linux 6.13, the same number on x86_64 and aarch64 */
#endif
/* Extended attributes cannot be set: tmpfs keeps user.* attributes in kernel memory outside
   its size= quota (300 MiB a round went into a layer of disk: 16Mi, and stayed in the
   snapshots made of it), and ENOTSUP is what a filesystem without them answers, which every
   program that tries them handles (cp -a, rsync -X, tar --xattrs go on without). */
static const int no_xattr_syscalls[] = {__NR_setxattr, __NR_lsetxattr, __NR_fsetxattr, __NR_setxattrat};
#define N_NO_XATTR (sizeof no_xattr_syscalls / sizeof no_xattr_syscalls[0])
#define FAMILY_VSOCK 40 /* AF_VSOCK */
/* New namespaces from inside a sandbox: never needed, and the door to kernel surface that
   is only reachable with namespace capabilities. */
#define CLONE_NAMESPACES (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | \
                          CLONE_NEWPID | CLONE_NEWNET | 0x00000080 /* CLONE_NEWTIME */)

static void apply_seccomp(void) {
    struct sock_filter program[24 + 2 * N_DENIED + 2 * N_NO_XATTR];
    size_t n = 0;
    program[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch));
    program[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SECCOMP_ARCH, 1, 0);
    program[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
    program[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
#if defined(__x86_64__)
    program[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000u, 0, 1); /* x32 */
    program[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
#endif
    for (size_t k = 0; k < N_DENIED; k++) {
        program[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)denied_syscalls[k], 0, 1);
        program[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA));
    }
    for (size_t k = 0; k < N_NO_XATTR; k++) {
        program[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)no_xattr_syscalls[k], 0, 1);
        program[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EOPNOTSUPP & SECCOMP_RET_DATA));
    }
    program[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_socket, 0, 4);
    program[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0]));
    program[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, FAMILY_VSOCK, 0, 1);
    program[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA));
    program[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    /* clone3 passes its flags in memory a filter cannot read: ENOSYS makes the C library
       fall back to clone, whose flags it can (as the container runtimes' defaults do). */
    program[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone3, 0, 1);
    program[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA));
    program[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 0, 3);
    program[n++] = (struct sock_filter)BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0]));
    program[n++] = (struct sock_filter)BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, CLONE_NAMESPACES, 0, 1);
    program[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA));
    program[n++] = (struct sock_filter)BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    struct sock_fprog fprog = {(unsigned short)n, program};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0) < 0) die("seccomp", NULL);
}
