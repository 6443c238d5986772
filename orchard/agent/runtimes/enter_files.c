/*
 * File calls done from inside a sandbox (included by orchard_enter.c).
 *
 * orchard-enter --file ... -- OP ARGS runs OP after it has joined the sandbox's
 * namespaces and cgroup, chrooted into its root, dropped every capability and switched
 * to the sandbox user: exactly the position of a command. So a path is resolved by the
 * sandbox's own kernel view and permissions, a planted symlink to /proc/sys reaches only
 * what the sandbox user could reach with a shell, and written pages are charged to the
 * sandbox's memory and disk limits.
 *
 *   read PATH MAX      stdout: "ok SIZE\n" then the bytes (SIZE is st_size: /proc reads 0)
 *   write PATH MODE    stdin: the bytes, which replace PATH atomically; stdout: "ok WRITTEN\n"
 *                      (MODE -1: the old file's mode, else 0644)
 *   list PATH OFF LIM  stdout: "ok TOTAL\0" then per entry "T SIZE SEC NSEC NAME\0",
 *                      names sorted bytewise, entries [OFF, OFF+LIM) only
 *
 * Failures exit 3 with one line "orchard-file: CODE" on stderr, CODE being E<errno>,
 * "notreg" (not a regular file / directory), or "toobig" (more than MAX bytes).
 * Special files are refused without blocking: every open is O_NONBLOCK, then checked.
 */
#include <dirent.h>
#include <limits.h>

#define FILE_ERROR 3
#define CHUNK (1 << 20)

static int file_fail(const char *code) {
    fprintf(stderr, "orchard-file: %s\n", code);
    return FILE_ERROR;
}

static int file_errno(void) {
    char code[16];
    snprintf(code, sizeof code, "E%d", errno);
    return file_fail(code);
}

static int write_all(int fd, const char *buf, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

static int blocking(int fd) {
    int flags = fcntl(fd, F_GETFL);
    return flags < 0 ? -1 : fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
}

static int file_read(const char *path, long long max) {
    int fd = open(path, O_RDONLY | O_NOCTTY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return file_errno();
    struct stat st;
    if (fstat(fd, &st) < 0) return file_errno();
    if (!S_ISREG(st.st_mode)) return file_fail("notreg");
    if (max >= 0 && st.st_size > max) return file_fail("toobig");
    if (blocking(fd) < 0) return file_errno();
    char header[48];
    int n = snprintf(header, sizeof header, "ok %lld\n", (long long)st.st_size);
    if (write_all(1, header, (size_t)n) < 0) return FILE_ERROR;
    static char buf[CHUNK];
    long long total = 0;
    for (;;) {
        ssize_t got = read(fd, buf, sizeof buf);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return file_errno();
        if (got == 0) return 0;
        total += got;
        if (max >= 0 && total > max) return file_fail("toobig"); /* grew while we read */
        if (write_all(1, buf, (size_t)got) < 0) return FILE_ERROR; /* the reader went away */
    }
}

/* mkdir -p of PATH's parent, as the sandbox user. */
static int make_parents(const char *path) {
    char buf[4096];
    size_t len = strlen(path);
    if (len >= sizeof buf) { errno = ENAMETOOLONG; return -1; }
    memcpy(buf, path, len + 1);
    char *slash = strrchr(buf, '/');
    if (slash == NULL || slash == buf) return 0;
    *slash = '\0';
    for (char *p = buf + 1; ; p++) {
        if (*p == '/' || *p == '\0') {
            char saved = *p;
            *p = '\0';
            if (mkdir(buf, 0755) < 0 && errno != EEXIST) return -1;
            *p = saved;
            if (saved == '\0') return 0;
        }
    }
}

/* Where a write to PATH lands: PATH with its symlinks resolved (inside the sandbox), or,
   for a new file, its resolved parent directory plus its name. */
static int write_target(const char *path, char *target, char *dir, char *base) {
    char parent[PATH_MAX];
    if (realpath(path, target) == NULL) {
        if (errno != ENOENT) return -1;
        size_t len = strlen(path);
        if (len >= sizeof parent) { errno = ENAMETOOLONG; return -1; }
        memcpy(parent, path, len + 1);
        char *slash = strrchr(parent, '/');
        if (slash == NULL || slash[1] == '\0') { errno = EISDIR; return -1; }
        const char *name = slash + 1;
        *slash = '\0';
        char resolved[PATH_MAX];
        if (realpath(parent[0] ? parent : "/", resolved) == NULL) return -1;
        if (snprintf(target, PATH_MAX, "%s/%s", strcmp(resolved, "/") ? resolved : "", name) >= PATH_MAX) {
            errno = ENAMETOOLONG;
            return -1;
        }
    }
    char *slash = strrchr(target, '/');
    snprintf(base, NAME_MAX + 1, "%s", slash + 1);
    snprintf(dir, PATH_MAX, "%.*s", (int)(slash == target ? 1 : slash - target), target);
    return 0;
}

/* Replace PATH atomically with stdin: the bytes go to an unnamed file (O_TMPFILE) in the
   target's directory, which is named and renamed over the target only when complete. A
   failed or killed upload leaves the old file as it was and nothing behind (an unnamed
   file dies with its last descriptor). An existing special file is refused, never opened. */
static int file_write(const char *path, long mode) {
    if (make_parents(path) < 0) return file_errno();
    char target[PATH_MAX], dir[PATH_MAX], base[NAME_MAX + 1], temp[PATH_MAX + NAME_MAX + 64];
    if (write_target(path, target, dir, base) < 0) return file_errno();
    struct stat st;
    int exists = lstat(target, &st) == 0;
    if (exists && !S_ISREG(st.st_mode)) return file_fail("notreg");
    mode_t final = mode >= 0 ? (mode_t)mode : exists ? (st.st_mode & 07777) : 0644;
    snprintf(temp, sizeof temp, "%s/.%.200s.orchard-upload-%d", strcmp(dir, "/") ? dir : "", base, (int)getpid());
    int named = 0;
    int fd = open(dir, O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
        fd = open(temp, O_WRONLY | O_CREAT | O_EXCL | O_NOCTTY | O_CLOEXEC, 0600); /* no O_TMPFILE here */
        named = 1;
    }
    if (fd < 0) return file_errno();
    static char buf[CHUNK];
    long long total = 0;
    for (;;) {
        ssize_t got = read(0, buf, sizeof buf);
        if (got < 0 && errno == EINTR) continue;
        if (got == 0) break;
        if (got < 0 || write_all(fd, buf, (size_t)got) < 0) {
            int saved = errno;
            if (named) unlink(temp);
            errno = saved;
            return file_errno();
        }
        total += got;
    }
    if (fchmod(fd, final) < 0) goto failed;
    if (!named) {
        char self[64];
        snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
        if (linkat(AT_FDCWD, self, AT_FDCWD, temp, AT_SYMLINK_FOLLOW) < 0) goto failed;
    }
    if (rename(temp, target) < 0) {
        int saved = errno;
        unlink(temp);
        errno = saved;
        goto failed;
    }
    close(fd);
    printf("ok %lld\n", total);
    return fflush(stdout) == 0 ? 0 : FILE_ERROR;
failed:;
    int saved = errno;
    if (named) unlink(temp);
    errno = saved;
    return file_errno();
}

static int by_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int file_list(const char *path, long long offset, long long limit) {
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return errno == ENOTDIR ? file_fail("notreg") : file_errno();
    DIR *dir = fdopendir(fd);
    if (dir == NULL) return file_errno();
    size_t count = 0, room = 256;
    char **names = malloc(room * sizeof *names);
    if (names == NULL) return file_errno();
    struct dirent *entry;
    errno = 0;
    while ((entry = readdir(dir)) != NULL) {
        if (!strcmp(entry->d_name, ".") || !strcmp(entry->d_name, "..")) continue;
        if (count == room) {
            room *= 2;
            char **grown = realloc(names, room * sizeof *names);
            if (grown == NULL) return file_errno();
            names = grown;
        }
        if ((names[count++] = strdup(entry->d_name)) == NULL) return file_errno();
    }
    if (errno != 0) return file_errno();
    qsort(names, count, sizeof *names, by_name);
    printf("ok %zu%c", count, '\0');
    for (long long i = offset; i >= 0 && (size_t)i < count && i < offset + limit; i++) {
        struct stat st;
        if (fstatat(dirfd(dir), names[i], &st, AT_SYMLINK_NOFOLLOW) < 0) continue; /* vanished */
        char kind = S_ISDIR(st.st_mode) ? 'd' : S_ISREG(st.st_mode) ? 'f' : S_ISLNK(st.st_mode) ? 'l' : 'o';
        printf("%c %lld %lld %ld %s%c", kind, (long long)st.st_size, (long long)st.st_mtim.tv_sec,
               st.st_mtim.tv_nsec, names[i], '\0');
    }
    return fflush(stdout) == 0 ? 0 : FILE_ERROR;
}

static int file_operation(char **args, int n) {
    if (n == 3 && !strcmp(args[0], "read")) return file_read(args[1], strtoll(args[2], NULL, 10));
    if (n == 3 && !strcmp(args[0], "write")) return file_write(args[1], strtol(args[2], NULL, 10));
    if (n == 4 && !strcmp(args[0], "list"))
        return file_list(args[1], strtoll(args[2], NULL, 10), strtoll(args[3], NULL, 10));
    fprintf(stderr, "orchard-enter: unknown file operation\n");
    return 125;
}
