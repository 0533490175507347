// gpu-inference-platform's stack-output contract, read from TypeScript: the outputs a StackReference
// returns, validated against the contract's JSON Schema (gpuinfra_contract/schema/contract-<v>.json)
// before anything uses them. docs/contract.md describes the keys.
import { readFileSync } from "node:fs";
import * as pulumi from "@pulumi/pulumi";
import Ajv2020, { ValidateFunction } from "ajv/dist/2020";

export interface GpuPool {
  name: string;
  capacity: "spot" | "on-demand";
  on_demand_fallback: boolean;
  gpu_model: string;
  gpus_per_node: number;
  node_selector: Record<string, string>;
  native_names?: string[];
}

/** The exec credential plugin a consumer's kubeconfig runs (contract 1.3). */
export interface KubeAuth {
  api_version: string;
  command: string;
  args?: string[];
  provide_cluster_info?: boolean;
  install_hint?: string | null;
}

export interface Cluster {
  cloud: "aws" | "gcp" | "existing";
  region: string;
  name: string;
  endpoint: string;
  oidc_issuer: string;
  gpu_pools: Record<string, GpuPool>;
  spot_notice_s: number;
  interruption_queue_arn?: string | null;
  ebpf_agent_metrics_port?: number | null;
  serving_namespace?: string | null; // contract 1.2
  client_namespace_labels?: Record<string, string>; // contract 1.2
  account?: string | null; // contract 1.3
  certificate_authority_data?: string | null; // contract 1.3
  kube_auth?: KubeAuth | null; // contract 1.3
}

export interface ModelEndpoint {
  cluster: string;
  pool: string;
  service_url: string;
  openai_base_path: string;
  metrics_url: string;
  router_url?: string | null; // contract 1.1
  router_local_url?: string | null; // contract 1.1
}

export interface ServedModel {
  served_model_name: string;
  tier: "primary" | "economy";
  endpoints: Record<string, ModelEndpoint>;
}

/** The plain outputs; `kubeconfigs` is a secret output, read with `requireOutput` instead. */
export interface PlatformOutputs {
  contract_version: string;
  environment: string;
  clusters: Record<string, Cluster>;
  models: Record<string, ServedModel>;
}

export const PLAIN_OUTPUTS = ["contract_version", "environment", "clusters", "models"] as const;

export class ContractError extends Error {
  override name = "ContractError";
}

export interface ContractValidator {
  id: string;
  validate: ValidateFunction<PlatformOutputs>;
}

/** Compiles the contract's JSON Schema (draft 2020-12) in ajv's strict mode. */
export function loadValidator(schemaFile: string): ContractValidator {
  const schema = JSON.parse(readFileSync(schemaFile, "utf8"));
  const ajv = new Ajv2020({ allErrors: true, strict: true });
  return { id: schema.$id, validate: ajv.compile<PlatformOutputs>(schema) };
}

/** The outputs, typed, or a ContractError naming every key that does not match. */
export function checkOutputs(raw: Record<string, unknown>, v: ContractValidator, source: string): PlatformOutputs {
  if (v.validate(raw)) {
    return raw;
  }
  const problems = (v.validate.errors ?? []).map((e) => `  - '${e.instancePath || "/"}' ${e.message}`);
  throw new ContractError(`${source} do not match ${v.id}:\n${problems.join("\n")}`);
}

/**
 * Reads the plain outputs of a platform stack and validates them. An output the stack does not
 * have is left out (getOutputValue gives undefined), so the error names it as a missing property.
 */
export async function readPlatform(ref: pulumi.StackReference, v: ContractValidator, source: string): Promise<PlatformOutputs> {
  const values = await Promise.all(PLAIN_OUTPUTS.map((key) => ref.getOutputValue(key)));
  const raw: Record<string, unknown> = {};
  PLAIN_OUTPUTS.forEach((key, i) => {
    if (values[i] !== undefined && values[i] !== null) {
      raw[key] = values[i];
    }
  });
  return checkOutputs(raw, v, source);
}

export function endpoint(o: PlatformOutputs, model: string, cluster?: string): ModelEndpoint {
  const served = o.models[model];
  if (served === undefined) {
    throw new ContractError(`model '${model}' is not served by this stack; served: ${Object.keys(o.models).sort().join(", ")}`);
  }
  const clusters = Object.keys(served.endpoints).sort();
  const name = cluster ?? (clusters.length === 1 ? clusters[0] : undefined);
  if (name === undefined || served.endpoints[name] === undefined) {
    throw new ContractError(`model '${model}' runs on ${clusters.join(", ")}; pick one of them as the cluster`);
  }
  return served.endpoints[name];
}

/** The OpenAI base URL to use: the router's where one runs (contract 1.1), else the Service's. */
export function recommendedBaseUrl(e: ModelEndpoint): string {
  const base = (e.router_url ?? e.service_url).replace(/\/+$/, "");
  return `${base}/${e.openai_base_path.replace(/^\/+|\/+$/g, "")}`;
}

/** A cluster's kubeconfig: always a secret Output, never a plain value. */
export function kubeconfig(ref: pulumi.StackReference, cluster: string): pulumi.Output<string> {
  return pulumi.secret(
    ref.requireOutput("kubeconfigs").apply((k: Record<string, string>) => {
      if (k?.[cluster] === undefined) {
        throw new ContractError(`no kubeconfig for cluster '${cluster}'; have: ${Object.keys(k ?? {}).sort().join(", ")}`);
      }
      return k[cluster];
    }),
  );
}
