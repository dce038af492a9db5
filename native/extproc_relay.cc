// isocost-extproc-relay: Envoy's ext_proc gRPC on one side, `isocost picker --relay` on the
// other, so that the picker's Python pays for its decisions and not for gRPC.
//
// Every gRPC call (whatever its method: ext_proc's Process, gRPC health's Check and
// Watch) is one stream of frames on a Unix socket the picker listens on; each frame is
// a little-endian header (stream id u64, kind u8, payload length u32) and the payload:
//
//   relay -> picker  OPEN (the method path), MESSAGE (one request message, as sent),
//                    HALF_CLOSE (the client sends no more), CANCEL (the call is gone:
//                    the client cancelled or its connection broke)
//   picker -> relay  MESSAGE (one response message, as it goes out), FINISH (the status:
//                    code u32, then the details)
//
// The messages are passed on as bytes: the picker decodes them. When the picker's socket
// closes, the relay exits at once (1), as the picker's own gRPC server would have gone
// with it; SIGTERM or SIGINT stops taking calls and gives the open ones the grace (the
// picker still answers them) before it exits (0).
//
//   isocost-extproc-relay --listen HOST:PORT --socket PATH [--grace-s S]
//
// It prints "isocost-extproc-relay: ready at HOST:PORT" (the port bound) once serving.

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

enum Kind : uint8_t {
  kOpen = 1,
  kMessage = 2,
  kHalfClose = 3,
  kCancel = 4,
  kFinish = 5,
};
constexpr size_t kHeader = 13;  // u64 stream id, u8 kind, u32 length
constexpr uint32_t kMaxPayload = 64u << 20;

class Stream;

// The picker's socket and the open streams. One recursive mutex guards the stream map
// and every stream's state: a gRPC operation started under it may run its reaction
// inline on the same thread, and the stream may be deleted there (OnDone), so nothing
// touches a stream after starting one of its operations.
class Bridge {
 public:
  explicit Bridge(int fd) : fd_(fd) {}

  std::recursive_mutex mu;

  void Send(uint64_t id, Kind kind, const std::string& payload) {
    unsigned char header[kHeader];
    std::memcpy(header, &id, 8);  // x86-64 and aarch64 Linux are little-endian
    header[8] = kind;
    uint32_t length = static_cast<uint32_t>(payload.size());
    std::memcpy(header + 9, &length, 4);
    std::lock_guard<std::mutex> lock(send_mu_);
    iovec parts[2] = {{header, kHeader}, {const_cast<char*>(payload.data()), payload.size()}};
    WriteAll(parts, payload.empty() ? 1 : 2);
  }

  uint64_t Register(Stream* stream) {  // mu held
    uint64_t id = next_id_++;
    streams_[id] = stream;
    return id;
  }

  void Unregister(uint64_t id) { streams_.erase(id); }  // mu held

  void ReadLoop();

 private:
  void WriteAll(iovec* parts, int count) {
    while (count > 0) {
      ssize_t n = writev(fd_, parts, count);
      if (n < 0) {
        if (errno == EINTR) continue;
        Gone("write");
      }
      while (count > 0 && static_cast<size_t>(n) >= parts->iov_len) {
        n -= static_cast<ssize_t>(parts->iov_len);
        ++parts;
        --count;
      }
      if (count > 0) {
        parts->iov_base = static_cast<char*>(parts->iov_base) + n;
        parts->iov_len -= static_cast<size_t>(n);
      }
    }
  }

  bool ReadAll(void* into, size_t size) {
    char* at = static_cast<char*>(into);
    while (size > 0) {
      ssize_t n = read(fd_, at, size);
      if (n == 0) return false;
      if (n < 0) {
        if (errno == EINTR) continue;
        return false;
      }
      at += n;
      size -= static_cast<size_t>(n);
    }
    return true;
  }

  [[noreturn]] static void Gone(const char* during) {
    std::fprintf(stderr, "isocost-extproc-relay: the picker's socket closed (%s): exiting\n",
                 during);
    std::fflush(stderr);
    std::_Exit(1);
  }

  int fd_;
  std::mutex send_mu_;
  std::unordered_map<uint64_t, Stream*> streams_;
  uint64_t next_id_ = 1;
};

class Stream : public grpc::ServerGenericBidiReactor {
 public:
  Stream(Bridge* bridge, const std::string& method) : bridge_(bridge) {
    {
      std::lock_guard<std::recursive_mutex> lock(bridge_->mu);
      id_ = bridge_->Register(this);
    }
    bridge_->Send(id_, kOpen, method);
    StartRead(&in_);
  }

  // The picker's answer, from the bridge's thread with mu held.
  void Deliver(const std::string& bytes) {
    if (finish_wanted_ || cancelled_) return;
    grpc::Slice slice(bytes);
    pending_.emplace_back(&slice, 1);
    if (!writing_) {
      writing_ = true;
      StartWrite(&pending_.front());  // the last use of this
    }
  }

  void Close(grpc::Status status) {  // mu held
    if (finish_wanted_) return;
    finish_wanted_ = true;
    status_ = std::move(status);
    MaybeFinish();
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client half-closed, or the call broke (OnCancel says which)
      bridge_->Send(id_, kHalfClose, std::string());
      return;
    }
    std::vector<grpc::Slice> slices;
    std::string bytes;
    if (in_.Dump(&slices).ok()) {
      for (const auto& slice : slices) {
        bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
      }
    }
    in_.Clear();
    bridge_->Send(id_, kMessage, bytes);
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::recursive_mutex> lock(bridge_->mu);
    pending_.pop_front();
    if (!ok) {
      pending_.clear();
      Cancelled();
    }
    if (!pending_.empty()) {
      StartWrite(&pending_.front());  // the last use of this
      return;
    }
    writing_ = false;
    MaybeFinish();
  }

  void OnCancel() override {
    std::lock_guard<std::recursive_mutex> lock(bridge_->mu);
    Cancelled();
    MaybeFinish();
  }

  void OnDone() override {
    {
      std::lock_guard<std::recursive_mutex> lock(bridge_->mu);
      bridge_->Unregister(id_);
    }
    delete this;
  }

 private:
  void Cancelled() {  // mu held
    if (cancelled_) return;
    cancelled_ = true;
    if (!finish_wanted_) bridge_->Send(id_, kCancel, std::string());
  }

  void MaybeFinish() {  // mu held; Finish is the last use of this
    if (finished_ || writing_ || !(finish_wanted_ || cancelled_)) return;
    finished_ = true;
    Finish(finish_wanted_ ? status_ : grpc::Status::CANCELLED);
  }

  Bridge* bridge_;
  uint64_t id_ = 0;
  grpc::ByteBuffer in_;
  std::deque<grpc::ByteBuffer> pending_;  // answers not written yet, the first being written
  bool writing_ = false;
  bool finish_wanted_ = false;  // the picker sent FINISH
  bool cancelled_ = false;
  bool finished_ = false;
  grpc::Status status_;
};

void Bridge::ReadLoop() {
  std::string payload;
  for (;;) {
    unsigned char header[kHeader];
    if (!ReadAll(header, kHeader)) Gone("read");
    uint64_t id;
    uint32_t length;
    std::memcpy(&id, header, 8);
    std::memcpy(&length, header + 9, 4);
    if (length > kMaxPayload) Gone("a frame past the size limit");
    payload.resize(length);
    if (length > 0 && !ReadAll(payload.data(), length)) Gone("read");
    std::lock_guard<std::recursive_mutex> lock(mu);
    auto found = streams_.find(id);
    if (found == streams_.end()) continue;  // gone already (cancelled meanwhile)
    if (header[8] == kMessage) {
      found->second->Deliver(payload);
    } else if (header[8] == kFinish && length >= 4) {
      uint32_t code;
      std::memcpy(&code, payload.data(), 4);
      found->second->Close(grpc::Status(static_cast<grpc::StatusCode>(code), payload.substr(4)));
    }
  }
}

class Relay : public grpc::CallbackGenericService {
 public:
  explicit Relay(Bridge* bridge) : bridge_(bridge) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context)
      override {
    return new Stream(bridge_, context->method());
  }

 private:
  Bridge* bridge_;
};

int Connect(const std::string& path) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (fd < 0 || path.size() >= sizeof(address.sun_path)) return -1;
  std::memcpy(address.sun_path, path.data(), path.size());
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr,
               "isocost-extproc-relay: %s\n"
               "usage: isocost-extproc-relay --listen HOST:PORT --socket PATH [--grace-s S]\n",
               why);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::string listen, path;
  double grace_s = 10.0;
  for (int i = 1; i < argc; i += 2) {
    std::string flag = argv[i];
    if (i + 1 >= argc) Usage(("no value for " + flag).c_str());
    if (flag == "--listen") {
      listen = argv[i + 1];
    } else if (flag == "--socket") {
      path = argv[i + 1];
    } else if (flag == "--grace-s") {
      char* end = nullptr;
      grace_s = std::strtod(argv[i + 1], &end);
      if (*end != '\0' || !(grace_s >= 0)) Usage("--grace-s is no number of seconds >= 0");
    } else {
      Usage(("unknown flag " + flag).c_str());
    }
  }
  if (listen.empty() || path.empty()) Usage("--listen and --socket are required");

  sigset_t stop_signals;  // waited for by one thread, blocked in every other
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a closed socket is seen as a failed write

  int fd = Connect(path);
  if (fd < 0) {
    std::fprintf(stderr, "isocost-extproc-relay: cannot connect to %s: %s\n", path.c_str(),
                 std::strerror(errno));
    return 1;
  }
  Bridge bridge(fd);
  Relay relay(&bridge);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterCallbackGenericService(&relay);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 1 << 20);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "isocost-extproc-relay: cannot listen on %s\n", listen.c_str());
    return 1;
  }
  std::thread reader([&bridge] { bridge.ReadLoop(); });
  reader.detach();  // it exits the process when the picker's socket closes
  std::thread stopper([&server, &stop_signals, grace_s] {
    int received = 0;
    sigwait(&stop_signals, &received);
    auto grace = std::chrono::system_clock::now() +
                 std::chrono::milliseconds(static_cast<int64_t>(grace_s * 1000));
    server->Shutdown(grace);
  });
  std::string host = listen.substr(0, listen.rfind(':'));
  std::printf("isocost-extproc-relay: ready at %s:%d\n", host.c_str(), port);
  std::fflush(stdout);
  server->Wait();
  stopper.join();
  return 0;
}
