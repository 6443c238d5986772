/*
 * The holder as a spawner (included by orchard_enter.c; `--hold --spawner FD`).
 *
 * The holder is already where a command must run: PID 1 of the sandbox's namespaces, in
 * its root, with its unprivileged uid, no capabilities, no_new_privs and the seccomp
 * filter. Forking commands from it saves the per-command exec of orchard-enter and its
 * seven setns calls. Being PID 1 it cannot be killed or stopped from inside its PID
 * namespace, and being non-dumpable it cannot be ptraced or have its descriptors taken by
 * the sandbox's own processes (same uid, no capabilities).
 *
 * One request = one SOCK_SEQPACKET message on FD: the payload "ID" and, by SCM_RIGHTS,
 * CTL, one socket of a pair the agent made for this command alone. The holder forks a
 * child ahead of any command (prepared_child): the child sends its own credentials on CTL
 * (SCM_CREDENTIALS: the kernel checks the pid and translates it to the agent's PID
 * namespace, so the agent learns the host pid without believing us) and waits. Where jobs
 * have cgroups of their own (v1), the agent then sends "g" with the job group's `tasks`
 * file, opened by the agent: the child writes "0" into it (a thread moving itself takes no
 * global lock, so no RCU grace period: 0.04 ms, against about 10 ms for the agent writing
 * the child's pid), closes it and answers "g"; the agent checks the group's member list
 * itself. The command comes later on CTL: the payload
 * "CWD\0ARGC\0ARG0\0...\0ENV0\0ENV1\0..." (NUL-terminated strings) with stdin, stdout and
 * stderr by SCM_RIGHTS; the child answers "x" and becomes the command: own session, stdio,
 * cwd, every other descriptor closed, exec. So a command's start costs one message to a
 * process that is already placed, not a fork and two round trips.
 * The holder answers on FD with "exit ID CODE" (CODE: status, or 128 + signal) when it
 * reaps the child, or "fail ID ERRNO" when it could not fork. The agent treats both as
 * claims of the sandbox about itself: a number, never a pid to act on.
 */
#include <sys/uio.h>

#define SPAWN_PAYLOAD_MAX (60 * 1024)
#define SPAWN_MAX_ARGS 4096
#define SPAWN_MAX_RUNNING 32
#define SPAWN_MAX_FDS 5 /* stdin, stdout, stderr, and up to two more at 3 and 4 (a prestarted shell's) */

static struct { pid_t pid; unsigned long id; } spawned[SPAWN_MAX_RUNNING];

/* One message with one control message (SCM_RIGHTS, SCM_CREDENTIALS) of `size` bytes. */
static ssize_t send_control(int sock, const void *data, size_t len, int type, const void *payload, size_t size) {
    struct iovec iov = {.iov_base = (void *)data, .iov_len = len};
    union { char buf[CMSG_SPACE(sizeof(struct ucred))]; struct cmsghdr align; } control;
    if (size > sizeof(struct ucred)) { errno = EINVAL; return -1; }
    memset(&control, 0, sizeof control);
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = CMSG_SPACE(size)};
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = type;
    cmsg->cmsg_len = CMSG_LEN(size);
    memcpy(CMSG_DATA(cmsg), payload, size);
    return sendmsg(sock, &msg, MSG_NOSIGNAL);
}

static void spawner_say(int sock, const char *what, unsigned long id, int value) {
    char line[64];
    int n = snprintf(line, sizeof line, "%s %lu %d", what, id, value);
    send(sock, line, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static void spawner_reaped(int sock, pid_t pid, int status) {
    for (int k = 0; k < SPAWN_MAX_RUNNING; k++) {
        if (spawned[k].pid != pid) continue;
        spawned[k].pid = 0;
        if (sock >= 0)
            spawner_say(sock, "exit", spawned[k].id,
                        WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
        return;
    }
}

/* The descriptors a message carried (SCM_RIGHTS): the first `max` into fds, the rest
   closed. Returns how many came. */
static int received_fds(struct msghdr *msg, int *fds, int max) {
    int n_fds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int k = 0; k < count; k++, n_fds++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof fd);
            if (n_fds < max) fds[n_fds] = fd;
            else close(fd);
        }
    }
    return n_fds;
}

/* Split "CWD\0ARGC\0ARG0\0...\0ENV0\0..." of n bytes (NUL-terminated strings) into cwd,
   argv and envp in place; 0 when it is malformed. `args` holds 2 * SPAWN_MAX_ARGS + 4. */
static int parse_command(char *payload, ssize_t n, char **args, char **cwd, char ***argv, char ***envp) {
    payload[n] = 0;
    int n_strings = 0;
    char *p = payload;
    for (; p < payload + n && n_strings < 2 * SPAWN_MAX_ARGS + 1; p += strlen(p) + 1)
        args[n_strings++] = p;
    long argc = n_strings >= 2 ? strtol(args[1], NULL, 10) : 0;
    if (argc < 1 || argc > SPAWN_MAX_ARGS || 2 + argc > n_strings || p < payload + n) return 0;
    /* argv ends with a NULL, then the env strings shifted by one, then a NULL. */
    int n_env = n_strings - 2 - (int)argc;
    *cwd = args[0];
    *argv = args + 2;
    *envp = args + 2 + argc + 1;
    memmove(*envp, args + 2 + argc, (size_t)n_env * sizeof(char *));
    (*envp)[n_env] = NULL;
    (*argv)[argc] = NULL;
    return 1;
}

/* `fd` moved to a number past those a command's descriptors go to (0 .. SPAWN_MAX_FDS - 1). */
static int above_stdio(int fd) {
    if (fd >= SPAWN_MAX_FDS) return fd;
    int moved = fcntl(fd, F_DUPFD_CLOEXEC, SPAWN_MAX_FDS);
    if (moved < 0) _exit(125);
    close(fd);
    return moved;
}

/* A child forked ahead of its command: it says who it is, waits (not dumpable: the
   sandbox's processes of the same uid cannot ptrace it or take its CTL socket or the job
   group's descriptor), joins the next job's cgroup when told, then gets the command with its stdio on CTL,
   acknowledges it with "x" and becomes it. Until its stdio arrives its errors go to the
   holder's log; after, to the command's own stderr, as orchard-enter's do. */
static void prepared_child(int ctl) {
    static char payload[SPAWN_PAYLOAD_MAX + 1];
    static char *args[2 * SPAWN_MAX_ARGS + 4];
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    ctl = above_stdio(ctl);
    if (setsid() < 0) die("setsid", NULL);
    /* Not dumpable while it waits (inherited from the holder): no PTRACE_SEIZE, no
       /proc/PID/mem or /proc/PID/fd for the sandbox's processes. It becomes dumpable only
       once it holds nothing but what the command gets (below, before exec, which would
       make it dumpable anyway): a brief dumpable window here let a sandbox process spinning
       PTRACE_SEIZE on ns_last_pid attach for good. */
    /* Tell the agent who we are: the kernel vouches for the pid (no capabilities here). */
    struct ucred self = {.pid = getpid(), .uid = getuid(), .gid = getgid()};
    if (send_control(ctl, "p", 1, SCM_CREDENTIALS, &self, sizeof self) != 1) _exit(125);
    union { char buf[CMSG_SPACE(SPAWN_MAX_FDS * sizeof(int))]; struct cmsghdr align; } control;
    struct iovec iov;
    struct msghdr msg;
    ssize_t n;
    int fds[SPAWN_MAX_FDS], n_fds, placed = 0;
    for (;;) { /* at most one placement ("g" and one descriptor), then the command */
        iov = (struct iovec){.iov_base = payload, .iov_len = SPAWN_PAYLOAD_MAX};
        msg = (struct msghdr){.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                              .msg_controllen = sizeof control.buf};
        do n = recvmsg(ctl, &msg, MSG_CMSG_CLOEXEC); while (n < 0 && errno == EINTR);
        if (n <= 0) _exit(125); /* the agent gave up on us */
        n_fds = received_fds(&msg, fds, SPAWN_MAX_FDS);
        if (n_fds != 1 || n != 1 || payload[0] != 'g') break;
        if (placed++ || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) _exit(125);
        if (write(fds[0], "0", 1) != 1) die("join the job's cgroup", NULL);
        close(fds[0]);
        if (send(ctl, "g", 1, MSG_NOSIGNAL) != 1) _exit(125);
    }
    char *cwd, **argv, **envp;
    if (n_fds < 3 || n_fds > SPAWN_MAX_FDS || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))
        || !parse_command(payload, n, args, &cwd, &argv, &envp))
        _exit(125); /* malformed: the agent sees CTL close without "x" and runs it the other way */
    for (int fd = 0; fd < n_fds; fd++) /* first all out of the way of the numbers they go to */
        fds[fd] = above_stdio(fds[fd]);
    for (int fd = 0; fd < n_fds; fd++)
        if (dup2(fds[fd], fd) < 0) _exit(125);
    if (chdir(cwd) < 0) die("chdir", cwd);
    if (send(ctl, "x", 1, MSG_NOSIGNAL) != 1) _exit(125);
    if (syscall(SYS_close_range, (unsigned)n_fds, ~0U, 0U) < 0)
        for (int fd = n_fds; fd < 1024; fd++) close(fd);
    /* Only the command's stdio is left: dumpable now, so /proc/self/oom_score_adj is ours. */
    if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) < 0) die("dumpable", NULL);
    int adj = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (adj < 0 || write(adj, "1000", 4) != 4) die("oom_score_adj", NULL);
    close(adj);
    environ = envp;
    execvp(argv[0], argv);
    fprintf(stderr, "orchard-enter: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(errno == ENOENT ? 127 : 126);
}

/* One request: fork a prepared child (prepared_child). Returns 0 when the agent closed
   its end (no more requests). */
static int spawner_request(int sock, int children, int lifeline) {
    char id_text[24];
    union { char buf[CMSG_SPACE(sizeof(int))]; struct cmsghdr align; } control;
    struct iovec iov = {.iov_base = id_text, .iov_len = sizeof id_text - 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n == 0) return 0;
    if (n < 0) return errno == EAGAIN || errno == EINTR;
    int ctl = -1, n_fds = received_fds(&msg, &ctl, 1);
    id_text[n] = 0;
    char *end = NULL;
    unsigned long id = strtoul(id_text, &end, 10);
    int slot = -1;
    for (int k = 0; k < SPAWN_MAX_RUNNING && slot < 0; k++)
        if (spawned[k].pid == 0) slot = k;
    /* A malformed request is dropped: the agent sees its CTL socket close. */
    if (n_fds != 1 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || end == id_text || *end || slot < 0) {
        if (ctl >= 0) close(ctl);
        return 1;
    }
    pid_t child = fork();
    if (child == 0) {
        close(sock);
        close(children);
        if (lifeline >= 0) close(lifeline);
        prepared_child(ctl);
    }
    close(ctl);
    if (child < 0) {
        spawner_say(sock, "fail", id, errno);
        return 1;
    }
    spawned[slot].pid = child;
    spawned[slot].id = id;
    return 1;
}
