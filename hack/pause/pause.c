/*
 * The local cluster's pod sandbox process (the "pause" container): it holds the pod's namespaces
 * open, reaps the zombies of any process re-parented to it (it is PID 1 of the pod when the pod
 * shares its PID namespace) and exits cleanly on SIGTERM or SIGINT.
 *
 *   gcc -static -Os -o pause pause.c    (lora_devcluster.images builds and packages it)
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stop_signal;

static void on_stop(int sig) { stop_signal = sig; }

static void on_child(int sig) {
    (void)sig;
    int saved = errno;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
    errno = saved;
}

static void handle(int sig, void (*handler)(int)) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = handler;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = sig == SIGCHLD ? SA_NOCLDSTOP | SA_RESTART : 0;
    if (sigaction(sig, &sa, NULL) < 0) {
        perror("pause: sigaction");
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && (strcmp(argv[1], "-v") == 0 || strcmp(argv[1], "--version") == 0)) {
        puts("pause (lora-devcluster) 3.10");
        return 0;
    }
    if (getpid() != 1) {
        fprintf(stderr, "pause: warning: not PID 1\n");
    }
    handle(SIGINT, on_stop);
    handle(SIGTERM, on_stop);
    handle(SIGCHLD, on_child);
    /* pause() returns after every handled signal; only a stop signal ends the loop. Checking
     * the flag with the signals blocked and waiting with sigsuspend closes the race between
     * the check and the wait. */
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    sigprocmask(SIG_BLOCK, &block, &old);
    while (!stop_signal) {
        sigsuspend(&old);
    }
    fprintf(stderr, "pause: shutting down, got signal %d\n", (int)stop_signal);
    return 0;
}
