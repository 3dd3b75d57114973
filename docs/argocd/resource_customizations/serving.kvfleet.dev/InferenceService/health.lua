-- Argo CD health check for serving.kvfleet.dev/InferenceService.
-- Healthy:     Ready=True and status.observedGeneration == metadata.generation.
-- Degraded:    Degraded=True (the operator's reason and message), once the current spec is observed.
-- Healthy too: spec.replicas 0 without autoscaling, once no pod is left (scaled to zero on purpose).
-- Progressing: no status yet, the current generation not yet observed, or rolling out / scaling; with
--              spec.routing.inferencePool, until status.routing names the InferencePool the operator made.
-- A routed InferenceService's Healthy message names its InferencePool (and HTTPRoute); a missing Gateway or
-- missing Inference Extension CRDs are Degraded conditions (GatewayNotFound, InferencePoolCRDMissing, ...).
local hs = {}

local function condition(conds, ctype)
  if conds == nil then
    return nil
  end
  for _, c in ipairs(conds) do
    if c.type == ctype then
      return c
    end
  end
  return nil
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  local text = c.message
  if text == nil or text == "" then
    text = fallback
  end
  if c.reason ~= nil and c.reason ~= "" then
    return c.reason .. ": " .. text
  end
  return text
end

local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
local status = obj.status

if status == nil or status.conditions == nil or #status.conditions == 0 then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to report status"
  return hs
end

if generation ~= nil and status.observedGeneration ~= generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation) ..
    " (observed: " .. tostring(status.observedGeneration) .. ")"
  return hs
end

local conds = status.conditions
local degraded = condition(conds, "Degraded")
local ready = condition(conds, "Ready")
local progressing = condition(conds, "Progressing")

-- A condition stamped with an older generation describes an older spec.
local function current(c)
  return c ~= nil and (c.observedGeneration == nil or generation == nil or c.observedGeneration == generation)
end

if current(degraded) and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded, "InferenceService is degraded")
  return hs
end

local spec = obj.spec or {}
local routing = status.routing
local wants_pool = spec.routing ~= nil and spec.routing.inferencePool ~= nil
if wants_pool and (routing == nil or routing.inferencePool == nil) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to create the InferencePool and its endpoint picker"
  return hs
end

-- Scaled to zero on purpose (as Argo CD treats a Deployment with 0 replicas): nothing to wait for.
local autoscaling = spec.autoscaling or {}
if spec.replicas == 0 and autoscaling.enabled ~= true and (status.replicas == nil or status.replicas == 0) then
  hs.status = "Healthy"
  hs.message = "Scaled to zero (spec.replicas: 0)"
  return hs
end

if current(ready) and ready.status == "True" and not (current(progressing) and progressing.status == "True") then
  hs.status = "Healthy"
  local fallback = "Ready"
  if status.readyReplicas ~= nil and status.replicas ~= nil then
    fallback = tostring(status.readyReplicas) .. "/" .. tostring(status.replicas) .. " replicas ready"
  end
  hs.message = describe(ready, fallback)
  if wants_pool then
    hs.message = hs.message .. "; routed by InferencePool " .. routing.inferencePool
    if routing.httpRoute ~= nil then
      hs.message = hs.message .. " (HTTPRoute " .. routing.httpRoute .. ")"
    end
  end
  return hs
end

hs.status = "Progressing"
if current(progressing) and progressing.status == "True" then
  hs.message = describe(progressing, "Rolling out")
else
  hs.message = describe(ready, "Waiting for Ready")
end
return hs
