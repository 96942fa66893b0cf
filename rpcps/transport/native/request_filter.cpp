// The request filter: torch's RPC request callback, narrowed to an allow-list of message types.
//
// torch's TensorPipe agent hands every incoming request to one C++ RequestCallback, fixed when the
// agent is built. The stock one (RequestCallbackImpl) runs whatever the message type says: a
// PYTHON_CALL goes through the unpickler rpcps restricts (pickling.py), but a SCRIPT_CALL runs a
// builtin operator or TorchScript function straight from the operator registry (aten::save writes a
// file, aten::from_file reads one), and RRef, autograd and profiling messages drive C++ state that no
// Python sees. This file subclasses RequestCallbackImpl and checks the type before anything in the
// message is deserialised: a listed type goes on to torch's own code unchanged, any other type is
// answered with an error, counted, and handed to a Python hook (rpcps counts and logs it there).
//
// make_agent builds torch's own TensorPipeAgent with this callback; request_filter.py puts it where
// torch's backend handler constructs the agent. What must not live here: which types are allowed
// (Python passes them per agent) and how refusals are logged (Python's hook).

#include <torch/csrc/distributed/rpc/message.h>
#include <torch/csrc/distributed/rpc/request_callback_impl.h>
#include <torch/csrc/distributed/rpc/tensorpipe_agent.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <pybind11/stl.h>

// Written by build.py next to the objects: RPCPS_TORCH_VERSION (the torch this was compiled
// against) and RPCPS_SOURCE_DIGEST (of this file). The loader refuses a build whose values differ.
#include "rpcps_build_info.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <bitset>
#include <cstdio>
#include <mutex>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace rpc = torch::distributed::rpc;

// Message types are small enum values (0x100..0x237 in torch 2.x), but a peer sends the type as a
// raw integer: anything outside the table counts in the last slot.
constexpr int kSlots = 1024;
constexpr int kOther = kSlots - 1;

int slotOf(int type) {
  return type >= 0 && type < kOther ? type : kOther;
}

// Every request type torch defines, by name (message.h). Python allows types by these names, so a
// torch that renumbers them is still read right, and one that drops a name fails at load.
const std::vector<std::pair<std::string, int>>& requestTypes() {
  static const std::vector<std::pair<std::string, int>> types = {
      {"SCRIPT_CALL", rpc::MessageType::SCRIPT_CALL},
      {"PYTHON_CALL", rpc::MessageType::PYTHON_CALL},
      {"SCRIPT_REMOTE_CALL", rpc::MessageType::SCRIPT_REMOTE_CALL},
      {"PYTHON_REMOTE_CALL", rpc::MessageType::PYTHON_REMOTE_CALL},
      {"SCRIPT_RREF_FETCH_CALL", rpc::MessageType::SCRIPT_RREF_FETCH_CALL},
      {"PYTHON_RREF_FETCH_CALL", rpc::MessageType::PYTHON_RREF_FETCH_CALL},
      {"RREF_USER_DELETE", rpc::MessageType::RREF_USER_DELETE},
      {"RREF_FORK_REQUEST", rpc::MessageType::RREF_FORK_REQUEST},
      {"RREF_CHILD_ACCEPT", rpc::MessageType::RREF_CHILD_ACCEPT},
      {"FORWARD_AUTOGRAD_REQ", rpc::MessageType::FORWARD_AUTOGRAD_REQ},
      {"BACKWARD_AUTOGRAD_REQ", rpc::MessageType::BACKWARD_AUTOGRAD_REQ},
      {"CLEANUP_AUTOGRAD_CONTEXT_REQ", rpc::MessageType::CLEANUP_AUTOGRAD_CONTEXT_REQ},
      {"RUN_WITH_PROFILING_REQ", rpc::MessageType::RUN_WITH_PROFILING_REQ},
      {"RREF_BACKWARD_REQ", rpc::MessageType::RREF_BACKWARD_REQ},
  };
  return types;
}

std::string typeName(int type) {
  for (const auto& [name, value] : requestTypes()) {
    if (value == type) {
      return name;
    }
  }
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "type 0x%x", static_cast<unsigned>(type));
  return buffer;
}

// Per-process counts, shared by every agent this process builds. Relaxed atomics: a count is a
// statistic, it orders nothing, and a relaxed add is the whole cost an allowed message pays.
std::array<std::atomic<uint64_t>, kSlots> accepted{};
std::array<std::atomic<uint64_t>, kSlots> refused{};

// The Python hook, called with the GIL for each refusal. Never destroyed: a py::object destructor
// run by static teardown after the interpreter finalised would crash the exit.
std::atomic<py::object*> hook{nullptr};

// The agents make_agent built, so Python can check that the running agent is one of them. Weak:
// a destroyed agent's address, reused by another allocation, must not pass for a filtered one.
std::mutex builtMutex;
std::vector<std::weak_ptr<rpc::TensorPipeAgent>> built;

void notifyPython(int type, const std::string& name, int64_t bytes) {
  py::object* target = hook.load(std::memory_order_acquire);
  if (target == nullptr || !Py_IsInitialized() || _Py_IsFinalizing()) {
    return;
  }
  try {
    py::gil_scoped_acquire gil;
    (*target)(type, name, bytes);
  } catch (const std::exception& e) {
    // The refusal stands whatever the hook does; the hook logs its own errors, this is the backstop.
    std::fprintf(stderr, "rpcps request filter: the refusal hook failed: %s\n", e.what());
  }
}

class RequestFilter : public rpc::RequestCallbackImpl {
 public:
  explicit RequestFilter(std::bitset<kSlots> allowed, std::string allowedNames)
      : allowed_(allowed), allowedNames_(std::move(allowedNames)) {}

 protected:
  c10::intrusive_ptr<rpc::JitFuture> processMessage(
      rpc::Message& request,
      std::vector<c10::Stream> streams) const override {
    const int slot = slotOf(static_cast<int>(request.type()));
    if (slot != kOther && allowed_.test(slot)) {
      accepted[slot].fetch_add(1, std::memory_order_relaxed);
      return rpc::RequestCallbackImpl::processMessage(request, std::move(streams));
    }
    return refuse(request, slot);
  }

 private:
  c10::intrusive_ptr<rpc::JitFuture> refuse(const rpc::Message& request, int slot) const {
    refused[slot].fetch_add(1, std::memory_order_relaxed);
    const int type = static_cast<int>(request.type());
    const std::string name = typeName(type);
    int64_t bytes = static_cast<int64_t>(request.payload().size());
    for (const auto& tensor : request.tensors()) {
      bytes += static_cast<int64_t>(tensor.nbytes());
    }
    notifyPython(type, name, bytes);
    // Not handleError(): it LOG(ERROR)s every time, and a peer's flood must not become one.
    const std::string text = "rpcps refused a " + name +
        " message: this process accepts only " + allowedNames_ +
        " requests (rpcps calls Python functions only; docs/SECURITY.md)";
    return asFuture(rpc::createExceptionResponse(text, request.id()));
  }

  const std::bitset<kSlots> allowed_;
  const std::string allowedNames_;
};

std::shared_ptr<rpc::TensorPipeAgent> makeAgent(
    const c10::intrusive_ptr<::c10d::Store>& store,
    std::string name,
    rpc::worker_id_t rank,
    std::optional<int> worldSize,
    rpc::TensorPipeRpcBackendOptions opts,
    std::unordered_map<std::string, rpc::DeviceMap> reverseDeviceMaps,
    std::vector<c10::Device> devices,
    const std::vector<int>& allowedTypes) {
  std::bitset<kSlots> allowed;
  std::string names;
  for (int type : allowedTypes) {
    TORCH_CHECK(type >= 0 && type < kOther, "message type ", type, " is out of range");
    allowed.set(type);
    names += (names.empty() ? "" : ", ") + typeName(type);
  }
  TORCH_CHECK(allowed.any(), "an agent that accepts no message type could not even join its group");
  auto agent = std::shared_ptr<rpc::TensorPipeAgent>(
      new rpc::TensorPipeAgent(
          store,
          std::move(name),
          rank,
          worldSize,
          std::move(opts),
          std::move(reverseDeviceMaps),
          std::move(devices),
          std::make_unique<RequestFilter>(allowed, names)),
      torch::impl::destroy_without_gil<rpc::TensorPipeAgent>);
  {
    std::lock_guard<std::mutex> lock(builtMutex);
    built.push_back(agent);
  }
  return agent;
}

py::dict counts(const std::array<std::atomic<uint64_t>, kSlots>& table) {
  py::dict out;
  for (int slot = 0; slot < kSlots; ++slot) {
    const uint64_t n = table[slot].load(std::memory_order_relaxed);
    if (n != 0) {
      out[py::str(slot == kOther ? std::string("out of range") : typeName(slot))] = n;
    }
  }
  return out;
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rpcps's RPC request filter: torch's TensorPipe agent with an allow-list of message types";
  m.attr("built_for") = RPCPS_TORCH_VERSION;
  m.attr("source_digest") = RPCPS_SOURCE_DIGEST;
  m.def(
      "request_types",
      []() {
        py::dict out;
        for (const auto& [name, value] : requestTypes()) {
          out[py::str(name)] = value;
        }
        return out;
      },
      "Every request message type torch defines: name -> value.");
  m.def(
      "make_agent",
      &makeAgent,
      py::arg("store"),
      py::arg("name"),
      py::arg("rank"),
      py::arg("world_size"),
      py::arg("rpc_backend_options"),
      py::arg("reverse_device_maps"),
      py::arg("devices"),
      py::arg("allowed_types"),
      "torch's TensorPipeAgent, with a request callback that refuses every type not in allowed_types.");
  m.def(
      "is_filtered",
      [](const std::shared_ptr<rpc::RpcAgent>& agent) {
        std::lock_guard<std::mutex> lock(builtMutex);
        return std::any_of(built.begin(), built.end(), [&](const auto& weak) {
          const auto alive = weak.lock();
          return alive != nullptr && static_cast<const rpc::RpcAgent*>(alive.get()) == agent.get();
        });
      },
      py::arg("agent"),
      "Whether this agent was built by make_agent (and so filters its requests).");
  m.def(
      "set_refusal_hook",
      [](py::object function) {
        // The previous hook is leaked on purpose (see `hook`); it is set once per process.
        hook.store(new py::object(std::move(function)), std::memory_order_release);
      },
      py::arg("hook"),
      "hook(type: int, name: str, message_bytes: int), called with the GIL for each refused request.");
  m.def("accepted_counts", []() { return counts(accepted); }, "Requests let through, by type name.");
  m.def("refused_counts", []() { return counts(refused); }, "Requests refused, by type name.");
}
