/* orchard-agent: start the bundled exec agent, wherever the bundle is mounted.
 *
 * Static, so it needs nothing from the image: no shell, no PATH, no libc, no Python. It
 * finds the bundle from its own path and runs the bundle's Python through the bundle's own
 * dynamic loader (--library-path, --inhibit-cache), so the image's libraries and
 * ld.so.cache are never consulted and no variable (LD_LIBRARY_PATH, PYTHONHOME,
 * PYTHONPATH) is set that commands could inherit. Python runs isolated (-I: the image's
 * PYTHON* variables are ignored). Python's C-locale coercion may set LC_CTYPE; the
 * original value is handed to the agent (--restore-env), which puts it back before it
 * runs anything.
 *
 * Built by `orchard agent bundle` with -DBUNDLE_ARCH="<uname -m>" -DBUNDLE_LOADER="<file>"
 * -DBUNDLE_PYTHON="<path under the bundle>".
 */
#define _GNU_SOURCE
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

static int bundle_dir(const char *argv0, char *out, size_t size) {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = 0;
    } else if (strchr(argv0, '/') == NULL || realpath(argv0, self) == NULL) {
        return -1; /* no /proc and a bare name: nowhere to look */
    }
    for (int up = 0; up < 2; up++) { /* DIR/bin/orchard-agent -> DIR */
        char *slash = strrchr(self, '/');
        if (slash == NULL) return -1;
        *slash = 0;
    }
    if (self[0] == 0) strcpy(self, "/");
    if (strlen(self) + 1 > size) return -1;
    strcpy(out, self);
    return 0;
}

int main(int argc, char **argv) {
    struct utsname machine;
    if (uname(&machine) != 0 || strcmp(machine.machine, BUNDLE_ARCH) != 0) {
        fprintf(stderr, "orchard-agent: this bundle was built for %s, but this machine is %s; "
                        "build one on a %s machine with `orchard agent bundle --out DIR`\n",
                BUNDLE_ARCH, machine.machine, machine.machine);
        return 126;
    }
    char dir[PATH_MAX], loader[PATH_MAX + 64], libs[PATH_MAX + 64], python[PATH_MAX + 64];
    if (bundle_dir(argc > 0 ? argv[0] : "", dir, sizeof dir) != 0) {
        fprintf(stderr, "orchard-agent: cannot find my own bundle directory (no /proc/self/exe; "
                        "start me by an absolute path)\n");
        return 127;
    }
    snprintf(loader, sizeof loader, "%s/lib/%s", dir, BUNDLE_LOADER);
    snprintf(libs, sizeof libs, "%s/lib", dir);
    snprintf(python, sizeof python, "%s/%s", dir, BUNDLE_PYTHON);

    const char *lc_ctype = getenv("LC_CTYPE");
    char restore[4096];
    if (lc_ctype != NULL) snprintf(restore, sizeof restore, "LC_CTYPE=%s", lc_ctype);
    else strcpy(restore, "LC_CTYPE");

    const char *fixed[] = {loader, "--inhibit-cache", "--library-path", libs, python, "-I", "-m", "orchard.agent",
                           "--restore-env", restore};
    size_t nfixed = sizeof fixed / sizeof fixed[0];
    char **args = calloc(nfixed + (size_t)argc + 1, sizeof(char *));
    if (args == NULL) return 127;
    for (size_t i = 0; i < nfixed; i++) args[i] = (char *)fixed[i];
    for (int i = 1; i < argc; i++) args[nfixed + (size_t)i - 1] = argv[i];
    execv(loader, args);
    fprintf(stderr, "orchard-agent: cannot run %s: ", loader);
    perror(NULL);
    return 127;
}
