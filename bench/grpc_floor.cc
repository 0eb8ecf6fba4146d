// The floor of a compiled gRPC front (bench/serving.py, "gRPC C++ empty server"): Google's C++
// gRPC server answering inference.GRPCInferenceService (gateway/proto) with canned messages that
// the real gateway gave for the same model, read from the files named below in the current
// directory. It does no work of its own, so what perf_analyzer measures against it is one gRPC
// round trip with a compiled server: what a gateway written in C++ or Rust would start from.
// Not part of the product; built by the benchmark where g++ and libgrpc++-dev are present.
#include <fstream>
#include <sstream>
#include <grpcpp/grpcpp.h>
#include "grpc_predict_v2.grpc.pb.h"
using namespace inference;
static std::string slurp(const char* p) { std::ifstream f(p, std::ios::binary); std::stringstream s; s << f.rdbuf(); return s.str(); }
class Svc final : public GRPCInferenceService::Service {
 public:
  ModelMetadataResponse md; ModelConfigResponse cfg; ModelInferResponse inf; ServerMetadataResponse sm;
  grpc::Status ServerLive(grpc::ServerContext*, const ServerLiveRequest*, ServerLiveResponse* r) override { r->set_live(true); return grpc::Status::OK; }
  grpc::Status ServerReady(grpc::ServerContext*, const ServerReadyRequest*, ServerReadyResponse* r) override { r->set_ready(true); return grpc::Status::OK; }
  grpc::Status ModelReady(grpc::ServerContext*, const ModelReadyRequest*, ModelReadyResponse* r) override { r->set_ready(true); return grpc::Status::OK; }
  grpc::Status ServerMetadata(grpc::ServerContext*, const ServerMetadataRequest*, ServerMetadataResponse* r) override { *r = sm; return grpc::Status::OK; }
  grpc::Status ModelMetadata(grpc::ServerContext*, const ModelMetadataRequest*, ModelMetadataResponse* r) override { *r = md; return grpc::Status::OK; }
  grpc::Status ModelConfig(grpc::ServerContext*, const ModelConfigRequest*, ModelConfigResponse* r) override { *r = cfg; return grpc::Status::OK; }
  grpc::Status ModelInfer(grpc::ServerContext*, const ModelInferRequest* q, ModelInferResponse* r) override { *r = inf; r->set_id(q->id()); return grpc::Status::OK; }
};
int main(int argc, char** argv) {  // argv[1]: host:port
  Svc s;
  s.md.ParseFromString(slurp("md.bin")); s.cfg.ParseFromString(slurp("cfg.bin")); s.inf.ParseFromString(slurp("inf.bin")); s.sm.ParseFromString(slurp("sm.bin"));
  grpc::ServerBuilder b; b.AddListeningPort(argv[1], grpc::InsecureServerCredentials()); b.RegisterService(&s);
  auto server = b.BuildAndStart(); printf("listening\n"); fflush(stdout); server->Wait();
}
