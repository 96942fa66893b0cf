// Test support for tests/integration/security/test_hostile_builtin_ops.py: what an attacker with a compiler
// sends to an rpcps process, through the caller's own (plain torch) RPC agent.
//
// aten::save is a TorchScript operator outside the dispatcher whose schema takes a type variable
// (`t item`), which torch's Python RPC API cannot convert: a stranger reaches it with native code
// like this. Nothing here is shipped: the package never imports it.

#include <torch/csrc/distributed/rpc/message.h>
#include <torch/csrc/distributed/rpc/rpc_agent.h>
#include <torch/csrc/distributed/rpc/script_call.h>
#include <torch/csrc/jit/runtime/operator.h>
#include <torch/extension.h>

#include <pybind11/stl.h>

#include <string>
#include <vector>

namespace {

namespace rpc = torch::distributed::rpc;

// "" when the peer ran it, else the error it answered with (or the timeout).
std::string send(c10::intrusive_ptr<rpc::Message> message, const std::string& dst, double timeoutS) {
  auto agent = rpc::RpcAgent::getCurrentRpcAgent();
  auto future = agent->send(agent->getWorkerInfo(dst), std::move(message), static_cast<float>(timeoutS));
  py::gil_scoped_release noGil;
  future->wait();
  return future->hasError() ? future->tryRetrieveErrorMessage() : "";
}

// A SCRIPT_CALL of the builtin operator `opName` (its first overload) with string arguments.
std::string sendBuiltin(const std::string& dst, const std::string& opName, const std::vector<std::string>& args, double timeoutS) {
  auto ops = torch::jit::getAllOperatorsFor(c10::Symbol::fromQualString(opName));
  TORCH_CHECK(!ops.empty(), "no operator ", opName, " in this process");
  std::vector<c10::IValue> stack(args.begin(), args.end());
  auto message = rpc::ScriptCall(ops.front(), std::move(stack)).toMessage();
  return send(std::move(message), dst, timeoutS);
}

// A request of any type value with a raw payload (what no torch API sends).
std::string sendType(const std::string& dst, int type, const std::string& payload, double timeoutS) {
  auto message = c10::make_intrusive<rpc::Message>(
      std::vector<char>(payload.begin(), payload.end()), std::vector<torch::Tensor>{}, static_cast<rpc::MessageType>(type));
  return send(std::move(message), dst, timeoutS);
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("send_builtin", &sendBuiltin, py::arg("dst"), py::arg("op_name"), py::arg("args"), py::arg("timeout_s"));
  m.def("send_type", &sendType, py::arg("dst"), py::arg("type"), py::arg("payload"), py::arg("timeout_s"));
}
