// A VMM allocation crossing a process boundary the way DBuffers do: one
// process (the daemon's role) creates and fills it and sends the exported fd
// with SCM_RIGHTS; another (a trainer's) imports, maps, reads and writes it;
// the first sees the write. Both are forked before anything touches CUDA
// (a CUDA context does not survive fork), and say "no GPU" with exit code 77.
// Label `gpu`.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "dbuf/gpu/device_memory.hpp"

namespace dbuf::gpu {
namespace {

constexpr int kNoGpu = 77;
constexpr unsigned char kFromDaemon = 0xab;
constexpr unsigned char kFromTrainer = 0xcd;

bool sendFd(int socket, int fd, std::uint64_t size) {
  iovec iov{&size, sizeof size};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), &fd, sizeof fd);
  return sendmsg(socket, &msg, 0) == static_cast<ssize_t>(sizeof size);
}

bool receiveFd(int socket, int& fd, std::uint64_t& size) {
  iovec iov{&size, sizeof size};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  if (recvmsg(socket, &msg, 0) != static_cast<ssize_t>(sizeof size)) return false;
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  if (cmsg == nullptr || cmsg->cmsg_type != SCM_RIGHTS) return false;
  std::memcpy(&fd, CMSG_DATA(cmsg), sizeof fd);
  return true;
}

bool gpuPresent() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

bool holds(const void* device, std::size_t bytes, unsigned char value) {
  std::vector<unsigned char> host(bytes);
  if (cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
  for (const unsigned char b : host) {
    if (b != value) return false;
  }
  return true;
}

/// The daemon's side: allocate, fill, export, send; then check the trainer's write.
int daemonSide(int socket) {
  if (!gpuPresent()) return kNoGpu;
  auto granularity = allocationGranularity(0);
  if (!granularity) return 2;
  auto memory = PhysicalMemory::create(0, 2 * *granularity);
  if (!memory) return 3;
  auto range = AddressRange::reserve(memory->size(), 0);
  if (!range || !range->map(0, *memory)) return 4;
  if (cudaMemset(range->pointer(), kFromDaemon, memory->size()) != cudaSuccess) return 5;
  if (cudaDeviceSynchronize() != cudaSuccess) return 5;
  auto fd = memory->exportFd();
  if (!fd || !sendFd(socket, fd->get(), memory->size())) return 6;
  char done = 0;
  if (read(socket, &done, 1) != 1) return 7;
  // The trainer wrote its first granule.
  return holds(range->pointer(), *granularity, kFromTrainer) &&
                 holds(range->pointer(*granularity), *granularity, kFromDaemon)
             ? 0
             : 8;
}

/// A trainer's side: import by fd, map at its own address, read, write.
int trainerSide(int socket) {
  if (!gpuPresent()) return kNoGpu;
  int fd = -1;
  std::uint64_t size = 0;
  if (!receiveFd(socket, fd, size)) return 12;
  const UniqueFd owned(fd);
  auto memory = PhysicalMemory::import(fd, size, 0);
  if (!memory) return 13;
  auto range = AddressRange::reserve(size, 0);
  if (!range || !range->map(0, *memory)) return 14;
  if (!holds(range->pointer(), size, kFromDaemon)) return 15;
  auto granularity = allocationGranularity(0);
  if (!granularity || cudaMemset(range->pointer(), kFromTrainer, *granularity) != cudaSuccess) return 16;
  if (cudaDeviceSynchronize() != cudaSuccess) return 16;
  const char done = 1;
  return write(socket, &done, 1) == 1 ? 0 : 17;
}

int exitCode(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

TEST(DeviceMemoryIpc, ATrainerProcessMapsTheDaemonsAllocationByFd) {
  int sockets[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sockets), 0);
  // Each child closes the other's end, so a child that fails early shows as
  // EOF to the other instead of leaving it blocked forever.
  const pid_t daemon = fork();
  if (daemon == 0) {
    close(sockets[1]);
    _exit(daemonSide(sockets[0]));
  }
  const pid_t trainer = fork();
  if (trainer == 0) {
    close(sockets[0]);
    _exit(trainerSide(sockets[1]));
  }
  close(sockets[0]);
  close(sockets[1]);
  const int daemon_code = exitCode(daemon);
  const int trainer_code = exitCode(trainer);
  if (daemon_code == kNoGpu) GTEST_SKIP() << "no usable CUDA device (cudaGetDeviceCount found none)";
  EXPECT_EQ(daemon_code, 0) << "daemon side failed at step " << daemon_code;
  EXPECT_EQ(trainer_code, 0) << "trainer side failed at step " << trainer_code;
}

}  // namespace
}  // namespace dbuf::gpu
