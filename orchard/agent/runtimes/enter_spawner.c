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
 * One request = one SOCK_SEQPACKET message on FD:
 *   payload  "ID\0CWD\0ARGC\0ARG0\0...\0ENV0\0ENV1\0..."  (NUL-terminated strings)
 *   SCM_RIGHTS  stdin, stdout, stderr and CTL, a socket of a pair the agent made for this
 *               command alone.
 * The child sends its own credentials on CTL (SCM_CREDENTIALS: the kernel checks the pid
 * and translates it to the agent's PID namespace, so the agent learns the host pid without
 * believing us), waits for one byte "g" (the agent has put it in the job's cgroup), then
 * becomes the command: own session, stdio, cwd, every other descriptor closed, exec.
 * The holder answers on FD with "exit ID CODE" (CODE: status, or 128 + signal) when it
 * reaps the command, or "fail ID ERRNO" when it could not fork. The agent treats both as
 * claims of the sandbox about itself: a number, never a pid to act on.
 */
#include <sys/uio.h>

#define SPAWN_PAYLOAD_MAX (60 * 1024)
#define SPAWN_MAX_ARGS 4096
#define SPAWN_MAX_RUNNING 32

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

/* In the child, until exec: errors go to the command's own stderr, as orchard-enter's do. */
static void spawned_child(int fds[4], const char *cwd, char **argv, char **envp) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int fd = 0; fd < 3; fd++)
        if (dup2(fds[fd], fd) < 0) _exit(125);
    if (setsid() < 0) die("setsid", NULL);
    /* The holder's own descriptors are closed (spawner_request): from here on this process
       holds only what the command gets (its stdio) and its CTL socket, so it may be dumpable
       (its /proc/self files then belong to it: oom_score_adj below), as exec makes it anyway. */
    if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) < 0) die("dumpable", NULL);
    int adj = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (adj < 0 || write(adj, "1000", 4) != 4) die("oom_score_adj", NULL);
    close(adj);
    /* Tell the agent who we are: the kernel vouches for the pid (no capabilities here). */
    struct ucred self = {.pid = getpid(), .uid = getuid(), .gid = getgid()};
    char go = 0;
    if (send_control(fds[3], "p", 1, SCM_CREDENTIALS, &self, sizeof self) != 1) _exit(125);
    if (recv(fds[3], &go, 1, 0) != 1 || go != 'g') _exit(125); /* the agent gave up on us */
    if (chdir(cwd) < 0) die("chdir", cwd);
    if (syscall(SYS_close_range, 3U, ~0U, 0U) < 0)
        for (int fd = 3; fd < 1024; fd++) close(fd);
    environ = envp;
    execvp(argv[0], argv);
    fprintf(stderr, "orchard-enter: cannot run %s: %s\n", argv[0], strerror(errno));
    _exit(errno == ENOENT ? 127 : 126);
}

/* Returns 0 when the agent closed its end (no more requests). */
static int spawner_request(int sock, int children, int lifeline) {
    static char payload[SPAWN_PAYLOAD_MAX + 1];
    static char *args[2 * SPAWN_MAX_ARGS + 4];
    union { char buf[CMSG_SPACE(4 * sizeof(int))]; struct cmsghdr align; } control;
    struct iovec iov = {.iov_base = payload, .iov_len = SPAWN_PAYLOAD_MAX};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n == 0) return 0;
    if (n < 0) return errno == EAGAIN || errno == EINTR;
    int fds[4] = {-1, -1, -1, -1}, n_fds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int k = 0; k < count; k++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof fd);
            if (n_fds < 4) fds[n_fds++] = fd;
            else close(fd);
        }
    }
    /* Parse: ID, CWD, ARGC, ARGV..., ENV... (a malformed request is dropped: the agent
       then sees its CTL socket close and runs the command the other way). */
    payload[n] = 0;
    int n_strings = 0;
    char *p = payload;
    for (; p < payload + n && n_strings < 2 * SPAWN_MAX_ARGS + 1; p += strlen(p) + 1)
        args[n_strings++] = p;
    long argc = n_strings >= 3 ? strtol(args[2], NULL, 10) : 0;
    int slot = -1;
    for (int k = 0; k < SPAWN_MAX_RUNNING && slot < 0; k++)
        if (spawned[k].pid == 0) slot = k;
    if (n_fds != 4 || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || argc < 1 || argc > SPAWN_MAX_ARGS ||
        3 + argc > n_strings || p < payload + n || slot < 0) {
        for (int k = 0; k < n_fds; k++) close(fds[k]);
        return 1;
    }
    unsigned long id = strtoul(args[0], NULL, 10);
    char **argv = args + 3, **envp = args + 3 + argc + 1;
    /* argv ends with a NULL, then the env strings shifted by one, then a NULL. */
    int n_env = n_strings - 3 - (int)argc;
    memmove(envp, args + 3 + argc, (size_t)n_env * sizeof(char *));
    envp[n_env] = NULL;
    argv[argc] = NULL;
    pid_t child = fork();
    if (child == 0) {
        close(sock);
        close(children);
        if (lifeline >= 0) close(lifeline);
        spawned_child(fds, args[1], argv, envp);
    }
    for (int k = 0; k < 4; k++) close(fds[k]);
    if (child < 0) {
        spawner_say(sock, "fail", id, errno);
        return 1;
    }
    spawned[slot].pid = child;
    spawned[slot].id = id;
    return 1;
}
