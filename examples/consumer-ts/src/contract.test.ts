// The contract helpers against the platform's real dev outputs, served by a mocked StackReference.
import { strict as assert } from "node:assert";
import { test } from "node:test";
import * as pulumi from "@pulumi/pulumi";
import { ContractError, endpoint, kubeconfig, loadValidator, readPlatform, recommendedBaseUrl } from "./contract";
import { mockStacks, Outputs, platformOutputs, schemaFile } from "./mocks";

const dev = platformOutputs();
const copy = (): any => JSON.parse(JSON.stringify(dev));
const variants: Record<string, Outputs> = {
  "acme/gpu-inference-platform/dev": dev,
  "acme/gpu-inference-platform/major2": { ...copy(), contract_version: "2.0.0" },
  "acme/gpu-inference-platform/no-endpoint": (() => {
    const d = copy();
    delete d.clusters["dev-use1"].endpoint;
    return d;
  })(),
  "acme/gpu-inference-platform/no-models": (() => {
    const d = copy();
    delete d.models;
    return d;
  })(),
  "acme/gpu-inference-platform/newer-minor": (() => {
    const d = copy();
    d.contract_version = "1.9.0";
    d.added_in_1_9 = { any: "thing" };
    d.clusters["dev-use1"].added_in_1_9 = true;
    return d;
  })(),
};
mockStacks(variants);
const validator = loadValidator(schemaFile());

function read(name: string) {
  const ref = new pulumi.StackReference(name.split("/")[2], { name });
  return readPlatform(ref, validator, `outputs of stack '${name}'`);
}

test("the dev stack's outputs match the schema and give the model's URL", async () => {
  const o = await read("acme/gpu-inference-platform/dev");
  assert.equal(o.contract_version, (dev as any).contract_version);
  const e = endpoint(o, "qwen3-8b", "dev-use1");
  const want = e.router_url ? `${e.router_url}/v1` : `${e.service_url}/v1`;
  assert.equal(recommendedBaseUrl(e), want);
  assert.equal(endpoint(o, "qwen3-8b"), e, "a model on one cluster needs no cluster name");
});

test("a producer of another major version is rejected", async () => {
  await assert.rejects(read("acme/gpu-inference-platform/major2"), (err: Error) => {
    assert.ok(err instanceof ContractError, String(err));
    assert.match(err.message, /'\/contract_version' must match pattern/);
    assert.match(err.message, /urn:gpuinfra:contract:platform-outputs:/);
    return true;
  });
});

test("a missing key is named", async () => {
  await assert.rejects(read("acme/gpu-inference-platform/no-endpoint"), /'\/clusters\/dev-use1' must have required property 'endpoint'/);
  await assert.rejects(read("acme/gpu-inference-platform/no-models"), /'\/' must have required property 'models'/);
});

test("a newer minor version with keys this consumer does not know is read", async () => {
  const o = await read("acme/gpu-inference-platform/newer-minor");
  assert.equal(o.contract_version, "1.9.0");
});

test("an unknown model names the served ones", async () => {
  const o = await read("acme/gpu-inference-platform/dev");
  assert.throws(() => endpoint(o, "nope"), /served: qwen3-8b/);
  assert.throws(() => endpoint(o, "qwen3-8b", "elsewhere"), /runs on dev-use1/);
});

test("the kubeconfig stays a secret, and getOutputValue refuses it", async () => {
  const ref = new pulumi.StackReference("dev-secret", { name: "acme/gpu-inference-platform/dev" });
  const kc = kubeconfig(ref, "dev-use1");
  assert.equal(await (kc as any).isSecret, true);
  await assert.rejects(ref.getOutputValue("kubeconfigs"), /secret/);
});
