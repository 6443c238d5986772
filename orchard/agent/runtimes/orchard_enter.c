/*
 * orchard-enter: the one exec between the agent and a sandboxed command.
 *
 * Why a helper: nsenter + setpriv would need setpriv inside every image, and a
 * shell wrapper to join cgroups costs another exec. This does it all in one:
 *
 *   orchard-enter [--cgroup FILE]... [--target PID --cwd DIR] [--uid N --gid N] -- ARGV...
 *
 *   --cgroup FILE  join the cgroup of FILE (a cgroup.procs) before anything else,
 *                  so every process the command starts is accounted and limited;
 *   --target PID   join all namespaces of PID (the owner of its user namespace first,
 *                  its own user namespace last), chroot into its root,
 *                  chdir to --cwd, drop the bounding set and all capabilities, set
 *                  no_new_privs, then fork so the child lands in the PID namespace;
 *                  the parent waits and exits with the child's status;
 *   --uid/--gid    switch to these ids (inside the user namespace with --target).
 *   --seccomp      install the default seccomp filter (enter_seccomp.c) before the command;
 *   --oom-first    make this process and all it starts the OOM killer's first choice
 *                  (oom_score_adj 1000; raising needs no privilege), so a sandbox at its
 *                  memory limit loses the command or file call that filled it, not its holder;
 *   --die-with-parent  (without --target) be killed when the agent dies, so a container tool
 *                  that detaches from us (unshare, ch-run) never outlives it; and ignore
 *                  SIGUSR1/SIGUSR2, which batch systems send to every process of a job as a
 *                  warning (the agent decides when its sandboxes end, not the warning);
 *   --file         ARGV is a file operation (enter_files.c) done in place of a command,
 *                  from exactly where a command would run;
 *   --hold         instead of a command, be a sandbox's holder: PID 1 of its namespaces,
 *                  reaping orphans until killed; write one line to --ready-fd first;
 *   --spawner FD   (with --hold) also fork commands for the agent: requests come on FD, a
 *                  socket pair the agent made (never a path: nothing in the sandbox can
 *                  reach it), see enter_spawner.c;
 *   --lifeline FD  (with --hold) exit, and so end the sandbox, when FD reads end of file:
 *                  the agent holds the pipe's other end, so a container tool that keeps
 *                  its own supervisor (Podman's conmon) never outlives the agent.
 *   --pty FD [--rows N --cols N]  run the command on a new pseudo-terminal allocated
 *                  *inside* the sandbox (its own devpts instance, opened after the chroot
 *                  and the id switch), never a host /dev/pts slave: the command gets only
 *                  the slave of a terminal that belongs to the sandbox. The master goes to
 *                  the agent over FD (a Unix socket, SCM_RIGHTS, with the command's pid);
 *                  the command's wait status follows on FD as "exit N" or "signal N".
 *
 * Exit status 125 means the helper itself failed; its reason is on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/nsfs.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <termios.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_CGROUPS 8

static void die(const char *what, const char *arg);
#include "enter_files.c"
#include "enter_seccomp.c"
#include "enter_spawner.c"

static void die(const char *what, const char *arg) {
    fprintf(stderr, "orchard-enter: %s%s%s: %s\n", what, arg ? " " : "", arg ? arg : "",
            strerror(errno));
    _exit(125);
}

/* Join a cgroup. In a v1 hierarchy we write "0" into its `tasks`: a thread moving itself
   skips the kernel's global threadgroup lock, whose taking waits for an RCU grace period
   (about 10 ms, 0.04 ms this way). We have one thread, so that moves the whole process.
   v2 has no `tasks` file: there our pid goes into cgroup.procs. */
static void join_cgroup(const char *procs_file) {
    char tasks[4096];
    const char *slash = strrchr(procs_file, '/');
    if (slash && !strcmp(slash, "/cgroup.procs") && (size_t)(slash - procs_file) + 7 < sizeof tasks) {
        snprintf(tasks, sizeof tasks, "%.*s/tasks", (int)(slash - procs_file), procs_file);
        int fd = open(tasks, O_WRONLY | O_CLOEXEC);
        if (fd >= 0) {
            if (write(fd, "0", 1) != 1) die("join cgroup", tasks);
            close(fd);
            return;
        }
    }
    int fd = open(procs_file, O_WRONLY | O_CLOEXEC);
    if (fd < 0) die("open cgroup", procs_file);
    char buf[32];
    int n = snprintf(buf, sizeof buf, "%d\n", (int)getpid());
    if (write(fd, buf, n) != n) die("join cgroup", procs_file);
    close(fd);
}

static int open_ns(const char *pid, const char *name) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%s/%s", pid, name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) die("open", path);
    return fd;
}

static struct stat current_user_ns; /* tracked by hand: /proc changes under us with the mount ns */

static void enter_user_ns(int fd, const char *what) {
    struct stat ns;
    if (fstat(fd, &ns) < 0) die("stat", what);
    if (ns.st_ino == current_user_ns.st_ino && ns.st_dev == current_user_ns.st_dev) return; /* already there */
    if (setns(fd, CLONE_NEWUSER) < 0) die("setns", what);
    current_user_ns = ns;
}

static int same_ns(int fd, const struct stat *ns) {
    struct stat st;
    return fstat(fd, &st) == 0 && st.st_ino == ns->st_ino && st.st_dev == ns->st_dev;
}

/* Of the user namespaces from ours down to the one behind fd, the first below ours
   (-1 when fd is ours, or is not below ours). */
static int outermost_user_ns(int fd) {
    if (same_ns(fd, &current_user_ns)) return -1;
    int below = dup(fd);
    for (;;) {
        int parent = ioctl(below, NS_GET_PARENT);
        if (parent < 0) { close(below); return -1; } /* not below ours */
        if (same_ns(parent, &current_user_ns)) { close(parent); return below; }
        close(below);
        below = parent;
    }
}

static void drop_all_capabilities(void) {
    for (int cap = 0; cap <= 63; cap++) {
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno == EINVAL) break;
    }
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
}

static void clear_capability_sets(void) {
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &hdr, data) < 0) die("capset", NULL);
}

static void switch_ids(long uid, long gid) {
    if (gid >= 0) {
        if (setgroups(0, NULL) < 0 && errno != EPERM) die("setgroups", NULL);
        if (setresgid(gid, gid, gid) < 0) die("setgid", NULL);
    }
    if (uid >= 0 && setresuid(uid, uid, uid) < 0) die("setuid", NULL);
}

/* A file call's helper works on the sandbox's files for the agent, through descriptors the
   agent gave it: no process of the sandbox may ptrace it or take those descriptors. The id
   switch makes it non-dumpable only where fs.suid_dumpable is 0, so say it outright. */
static void not_dumpable(void) {
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) die("dumpable", NULL);
}

static int hold(int ready_fd, int lifeline, int spawner) {
    /* Not dumpable: a sandbox process of the same uid cannot ptrace its PID 1 and make it
       exit (which would lose the sandbox and free its pids for reuse), nor take its
       descriptors (the spawner's socket) through /proc/1/fd or pidfd_getfd. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0) die("dumpable", NULL);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die("no_new_privs", NULL);
    apply_seccomp();
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int children = signalfd(-1, &chld, SFD_CLOEXEC);
    if (children < 0) die("signalfd", NULL);
    if (spawner >= 0 && fcntl(spawner, F_SETFD, FD_CLOEXEC) < 0) die("fcntl", "--spawner");
    if (ready_fd >= 0) {
        if (write(ready_fd, "ready\n", 6) != 6) return 125;
        close(ready_fd);
    }
    struct pollfd watched[3] = {{.fd = children, .events = POLLIN}, {.fd = lifeline, .events = POLLIN},
                                {.fd = spawner, .events = POLLIN}};
    for (;;) {
        if (poll(watched, 3, -1) < 0) {
            if (errno == EINTR) continue;
            die("poll", NULL);
        }
        if (watched[0].revents) {
            struct signalfd_siginfo info;
            if (read(children, &info, sizeof info) < 0 && errno != EAGAIN) die("signalfd read", NULL);
            int status;
            pid_t pid;
            while ((pid = waitpid(-1, &status, WNOHANG)) > 0) spawner_reaped(spawner, pid, status);
        }
        if (lifeline >= 0 && watched[1].revents) {
            char byte;
            if (read(lifeline, &byte, 1) <= 0) return 0;  /* the agent is gone: so is the sandbox */
        }
        if (spawner >= 0 && watched[2].revents) {
            if (!spawner_request(spawner, children, lifeline)) { /* the agent closed its end */
                close(spawner);
                spawner = watched[2].fd = -1;
            }
        }
    }
}

/* --pts-max N --target PID: cap the sandbox's own devpts instance (bwrap's --dev mounts
   one with no max=) at N terminals. The kernel's pool (kernel.pty.max) is host-wide: one
   sandbox that opened 3,071 took it from every other. The holder is up and nothing of the
   sandbox has run yet; no program is executed after entering its mount namespace. */
static int limit_ptys(const char *target, const char *max) {
    char options[64];
    long n = strtol(max, NULL, 10);
    if (n < 1) { fprintf(stderr, "orchard-enter: --pts-max needs a positive number\n"); return 125; }
    if (stat("/proc/self/ns/user", &current_user_ns) < 0) die("stat", "/proc/self/ns/user");
    int outermost = outermost_user_ns(open_ns(target, "ns/user"));
    int mnt_fd = open_ns(target, "ns/mnt");
    if (outermost >= 0) enter_user_ns(outermost, "the sandbox's outermost user namespace");
    if (setns(mnt_fd, CLONE_NEWNS) < 0) die("setns", "ns/mnt");
    /* bwrap's own options again (a remount resets those left out), and the cap */
    snprintf(options, sizeof options, "newinstance,ptmxmode=0666,mode=620,max=%ld", n);
    if (mount(NULL, "/dev/pts", NULL, MS_REMOUNT | MS_NOSUID | MS_NOEXEC, options) < 0) die("remount", "/dev/pts");
    return 0;
}

static int pty_sock = -1, pty_rows = 24, pty_cols = 80;

/* A master on the devpts of whatever mount namespace and root we are in now. */
static int open_pty_master(void) {
    int master = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (master < 0) die("open", "/dev/ptmx");
    int unlock = 0;
    if (ioctl(master, TIOCSPTLCK, &unlock) < 0) die("unlockpt", NULL);
    struct winsize size = {.ws_row = (unsigned short)pty_rows, .ws_col = (unsigned short)pty_cols};
    if (ioctl(master, TIOCSWINSZ, &size) < 0) die("TIOCSWINSZ", NULL);
    return master;
}

/* In the command's process: a session of its own with the slave as controlling terminal. */
static void pty_child(int master) {
    if (setsid() < 0) die("setsid", NULL);
    int slave = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY);
    if (slave < 0) {
        unsigned int n;
        char path[64];
        if (ioctl(master, TIOCGPTN, &n) < 0) die("TIOCGPTN", NULL);
        snprintf(path, sizeof path, "/dev/pts/%u", n);
        slave = open(path, O_RDWR | O_NOCTTY);
        if (slave < 0) die("open", path);
    }
    if (ioctl(slave, TIOCSCTTY, 0) < 0) die("TIOCSCTTY", NULL);
    for (int fd = 0; fd < 3; fd++)
        if (dup2(slave, fd) < 0) die("dup2", NULL);
    if (slave > 2) close(slave);
    close(master);
    close(pty_sock);
}

/* Outside: hand the master and the pid to the agent, then report how the command ended. */
static int pty_parent(pid_t child, int master) {
    char data[32];
    int n = snprintf(data, sizeof data, "%d", (int)child);
    if (send_control(pty_sock, data, (size_t)n, SCM_RIGHTS, &master, sizeof master) < 0) {
        kill(child, SIGKILL);
        die("sendmsg", NULL);
    }
    close(master);
    signal(SIGINT, SIG_IGN);
    signal(SIGQUIT, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    int status;
    while (waitpid(child, &status, 0) < 0) {
        if (errno != EINTR) die("waitpid", NULL);
    }
    n = WIFEXITED(status) ? snprintf(data, sizeof data, "exit %d", WEXITSTATUS(status))
                          : snprintf(data, sizeof data, "signal %d", WTERMSIG(status));
    send(pty_sock, data, (size_t)n, MSG_NOSIGNAL);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static int wait_and_relay(pid_t child) {
    int status;
    while (waitpid(child, &status, 0) < 0) {
        if (errno != EINTR) die("waitpid", NULL);
    }
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    return 128 + WTERMSIG(status);
}

int main(int argc, char **argv) {
    const char *cgroups[MAX_CGROUPS];
    int n_cgroups = 0;
    const char *target = NULL, *cwd = NULL, *pts_max = NULL, *nofile = NULL;
    long uid = -1, gid = -1;
    int i = 1, holder = 0, ready_fd = -1, lifeline = -1, spawner = -1, file = 0, seccomp = 0, oom_first = 0, die_with_parent = 0;
    for (; i < argc; i++) {
        if (!strcmp(argv[i], "--")) { i++; break; }
        if (!strcmp(argv[i], "--hold")) { holder = 1; continue; }
        if (!strcmp(argv[i], "--file")) { file = 1; continue; }
        if (!strcmp(argv[i], "--seccomp")) { seccomp = 1; continue; }
        if (!strcmp(argv[i], "--oom-first")) { oom_first = 1; continue; }
        if (!strcmp(argv[i], "--die-with-parent")) { die_with_parent = 1; continue; }
        if (i + 1 >= argc) { fprintf(stderr, "orchard-enter: %s needs a value\n", argv[i]); return 125; }
        if (!strcmp(argv[i], "--cgroup") && n_cgroups < MAX_CGROUPS) cgroups[n_cgroups++] = argv[++i];
        else if (!strcmp(argv[i], "--target")) target = argv[++i];
        else if (!strcmp(argv[i], "--cwd")) cwd = argv[++i];
        else if (!strcmp(argv[i], "--uid")) uid = strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--gid")) gid = strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--ready-fd")) ready_fd = (int)strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--lifeline")) lifeline = (int)strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--spawner")) spawner = (int)strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--pty")) pty_sock = (int)strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--rows")) pty_rows = (int)strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--cols")) pty_cols = (int)strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--pts-max")) pts_max = argv[++i];
        else if (!strcmp(argv[i], "--nofile")) nofile = argv[++i];
        else { fprintf(stderr, "orchard-enter: unknown option %s\n", argv[i]); return 125; }
    }
    if (nofile) {
        /* --nofile SOFT:HARD: the sandbox's own open-files limit (the agent raised its own to
           the hard limit, and everything it starts inherited that: 1,001,833 files were held
           open by 50 processes of one sandbox) */
        struct rlimit limit;
        char *rest = NULL;
        limit.rlim_cur = strtoul(nofile, &rest, 10);
        limit.rlim_max = (rest && *rest == ':') ? strtoul(rest + 1, NULL, 10) : limit.rlim_cur;
        if (limit.rlim_cur > limit.rlim_max || setrlimit(RLIMIT_NOFILE, &limit) < 0) die("setrlimit", nofile);
    }
    if (holder) return hold(ready_fd, lifeline, spawner);
    if (pts_max) {
        if (!target) { fprintf(stderr, "orchard-enter: --pts-max needs --target\n"); return 125; }
        return limit_ptys(target, pts_max);
    }
    if (i >= argc) { fprintf(stderr, "orchard-enter: no command\n"); return 125; }
    char **command = argv + i;

    for (int c = 0; c < n_cgroups; c++) join_cgroup(cgroups[c]);
    if (oom_first) {
        int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "1000", 4) != 4) die("oom_score_adj", NULL);
        close(fd);
    }

    if (target) {
        /* Container tools nest the holder's user namespace inside others that own its
           other namespaces (bwrap one level, unshare + ch-run three): join the outermost
           one below ours first (it is ours, so we get its capabilities, and so over
           everything nested in it, even without root), then the other namespaces, then
           the holder's own user namespace. */
        static const char *names[] = {"ns/ipc", "ns/uts", "ns/net", "ns/pid", "ns/cgroup", "ns/mnt"};
        if (stat("/proc/self/ns/user", &current_user_ns) < 0) die("stat", "/proc/self/ns/user");
        int user_fd = open_ns(target, "ns/user");
        int outermost = outermost_user_ns(user_fd);
        int fds[6]; /* opened before any setns: from inside a user namespace we could lose the
                       right to read another process's /proc/PID/ns (ptrace access rules) */
        for (int k = 0; k < 6; k++) {
            /* A namespace the sandbox shares with us (the host network, when it has one)
               is not joined: it may belong to a user namespace we hold no rights in. */
            char mine_path[64];
            struct stat theirs, mine;
            snprintf(mine_path, sizeof mine_path, "/proc/self/%s", names[k]);
            fds[k] = open_ns(target, names[k]);
            if (fstat(fds[k], &theirs) == 0 && stat(mine_path, &mine) == 0 &&
                theirs.st_ino == mine.st_ino && theirs.st_dev == mine.st_dev) {
                close(fds[k]);
                fds[k] = -1;
            }
        }
        int root = open_ns(target, "root");
        if (outermost >= 0) {
            enter_user_ns(outermost, "outermost user namespace");
            close(outermost);
        }
        for (int k = 0; k < 6; k++) {
            if (fds[k] < 0) continue;
            if (setns(fds[k], 0) < 0) die("setns", names[k]);
            close(fds[k]);
        }
        enter_user_ns(user_fd, "ns/user");
        close(user_fd);
        if (fchdir(root) < 0 || chroot(".") < 0) die("chroot", NULL);
        close(root);
        if (chdir(cwd ? cwd : "/") < 0) die("chdir", cwd ? cwd : "/");
    } else if (cwd && chdir(cwd) < 0) {
        die("chdir", cwd);
    }
    if (target) {
        drop_all_capabilities();
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die("no_new_privs", NULL);
        switch_ids(uid, gid);
        clear_capability_sets();
        if (file) not_dumpable();
        int master = pty_sock >= 0 ? open_pty_master() : -1;
        pid_t child = fork();
        if (child < 0) die("fork", NULL);
        if (child > 0) {
            if (master >= 0) return pty_parent(child, master);
            /* Stay out of the way of job control: the parent only relays the status. */
            signal(SIGINT, SIG_IGN);
            signal(SIGQUIT, SIG_IGN);
            return wait_and_relay(child);
        }
        prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
        if (master >= 0) pty_child(master);
    } else {
        switch_ids(uid, gid);
        if (file) not_dumpable();
        /* After the id switch, which would clear it; kept across the exec that follows. */
        if (die_with_parent && prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) die("pdeathsig", NULL);
        if (die_with_parent && getppid() == 1) _exit(125); /* the agent is already gone */
        if (die_with_parent) {
            signal(SIGUSR1, SIG_IGN);
            signal(SIGUSR2, SIG_IGN);
        }
        if (seccomp && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die("no_new_privs", NULL);
        if (pty_sock >= 0) { /* in place (runtime direct): the same split as with --target */
            int master = open_pty_master();
            pid_t child = fork();
            if (child < 0) die("fork", NULL);
            if (child > 0) return pty_parent(child, master);
            prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
            pty_child(master);
        }
    }
    if (seccomp) {
        /* Nothing the agent holds reaches the command (its listening socket, in a container
           where the agent runs in place). */
        if (syscall(SYS_close_range, 3U, ~0U, 0U) < 0)
            for (int fd = 3; fd < 1024; fd++) close(fd);
        apply_seccomp();
    }
    if (file) return file_operation(command, argc - i);
    execvp(command[0], command);
    fprintf(stderr, "orchard-enter: cannot run %s: %s\n", command[0], strerror(errno));
    _exit(errno == ENOENT ? 127 : 126);
}
