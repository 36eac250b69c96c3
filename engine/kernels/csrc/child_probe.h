// Runs a kernel path's probe in a child process, so an instruction that traps (cpuid flags are not
// proof that it runs) kills the child, not the server. Shared by the block kernels' paths
// (block_paths.cpp) and the bf16 attention (attention_bf16.cpp).
#pragma once

#include <cerrno>
#include <cstring>
#include <functional>
#include <string>

#if defined(__unix__)
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace kvprobe {

// "" when `same` ran in a child and returned true (the path gave the reference bits), else why
// not: the signal that killed it, `differ` when it returned false, or a failure. Where no child
// process can be made, "" (the flags are all there is to go by). The child only computes: make its
// inputs before the call.
inline std::string in_child(const std::function<bool()>& same, const std::string& differ) {
#if defined(__unix__)
  const pid_t pid = fork();
  if (pid < 0) return "";
  if (pid == 0) {
    alarm(30);  // a child that hangs (it should not: no locks, no allocation) dies instead
    _exit(same() ? 0 : 3);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return "";
  if (WIFSIGNALED(status))
    return "its probe died with signal " + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  if (WIFEXITED(status) && WEXITSTATUS(status) == 3) return differ;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "its probe failed";
#else
  (void)same, (void)differ;
#endif
  return "";
}

}  // namespace kvprobe
